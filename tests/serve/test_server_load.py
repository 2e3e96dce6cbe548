"""A bounded load test of the live server: 64 concurrent streaming requests (completions and chats, mixed prompt
and output lengths, greedy and seeded), 16 of them cancelled by the client mid-stream. Every other request gets
the tokens it gets alone; afterwards /metrics shows every KV block and KDA slot free and nothing running, and the
server still answers."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import pytest

import rocm_k3
from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.engine.chat import ChatRequest
from rocm_k3.sampling_params import SamplingParams
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server

MAX_LEN = 1024
ENGINE = EngineArgs(dtype="float32", max_model_len=MAX_LEN, max_num_seqs=32)

# (kind, prompt, max_tokens, temperature, seed): 6 completing shapes x 8 copies = 48 requests
SHAPES = [
    ("completion", "a", 2, 0.0, None),
    ("completion", "a longer prompt " * 8, 12, 0.0, None),
    ("completion", "seeded sampling", 9, 0.9, 5),
    ("completion", "x" * 300, 20, 0.0, None),
    ("chat", "hi", 6, 0.0, None),
    ("chat", "tell me a long story " * 4, 14, 1.0, 8),
]
LONG = ("completion", "never finishes", 1000, 0.0, None)  # cancelled: would run ~1000 steps if not aborted
COPIES, CANCELLED = 8, 16


@pytest.fixture(scope="module")
def llm():
    return rocm_k3.LLM(dtype="float32", max_model_len=MAX_LEN)


def _alone(llm, shape) -> list[int]:
    kind, prompt, max_tokens, temperature, seed = shape
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    if kind == "completion":
        return llm.generate(prompt, params)[0].token_ids
    prepared = llm.frontend.prepare_chat(ChatRequest([{"role": "user", "content": prompt}]))
    return llm.generate(prepared.prompt_token_ids, prepared.sampling(params))[0].token_ids


async def _stream(client, model: str, shape, cancel_after: int | None) -> list[int]:
    kind, prompt, max_tokens, temperature, seed = shape
    extra = {"ignore_eos": True, "return_token_ids": True}
    if kind == "completion":
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 temperature=temperature, seed=seed, extra_body=extra)
    else:
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens, stream=True, temperature=temperature,
                                                      seed=seed, extra_body=extra)
    ids: list[int] = []
    chunks = 0
    async for chunk in stream:
        if chunk.choices:
            ids += getattr(chunk.choices[0], "token_ids", None) or []
            chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            await stream.close()  # the client goes away mid-stream
            break
    return ids


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}  # labelled series summed per name
    for m in re.finditer(r"^(rocm_k3_\w+)(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_64_concurrent_streams_with_16_cancelled(llm) -> None:
    want = [_alone(llm, s) for s in SHAPES]
    with running_server(ENGINE, ServerArgs(port=0, uvicorn_log_level="warning")) as srv:
        model = srv.served.names[0]
        jobs = [(i, s, None) for i, s in enumerate(SHAPES) for _ in range(COPIES)]
        jobs += [(-1, LONG, 2 + k % 3) for k in range(CANCELLED)]
        jobs = jobs[::2] + jobs[1::2]  # interleave the shapes and the cancelled ones

        async def main():
            client = srv.async_client()
            try:
                return await asyncio.wait_for(
                    asyncio.gather(*(_stream(client, model, s, c) for _, s, c in jobs)), timeout=300)
            finally:
                await client.close()

        t0 = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - t0
        for (i, shape, cancel), ids in zip(jobs, results):
            if cancel is None:
                assert ids == want[i], shape
            else:
                assert 1 <= len(ids) < 50, len(ids)
        deadline = time.monotonic() + 60
        while True:  # the aborts land between steps; then everything is free
            m = _metrics(srv.base_url)
            idle = m["rocm_k3_requests_running"] == 0 and m["rocm_k3_requests_waiting"] == 0
            if idle and m["rocm_k3_kv_blocks_free"] == m["rocm_k3_kv_blocks_total"] \
                    and m["rocm_k3_kda_slots_free"] == m["rocm_k3_kda_slots_total"]:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        stats = srv.engine.stats()
        assert stats["free_blocks"] == stats["num_blocks"] and stats["free_state_slots"] == stats["num_state_slots"]
        assert stats["steps"] < 400, stats  # the cancelled 1000-token requests were aborted, not run out
        assert m["rocm_k3_requests_finished_total"] >= len(SHAPES) * COPIES
        again = srv.client().completions.create(model=model, prompt=SHAPES[1][1], max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
        assert again.choices[0].token_ids == want[1]
        print(f"64 streams ({CANCELLED} cancelled) in {elapsed:.1f} s, {stats['steps']} engine steps")
