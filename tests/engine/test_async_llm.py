"""AsyncLLM: the asyncio front over one engine core on its own thread. Concurrent requests get the tokens they
get alone; a stream closed or cancelled early aborts its request (the cache is free afterwards); bad requests
fail at add time and leave the engine serving; an engine failure fails every in-flight request and refuses new
ones instead of hanging."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

import rocm_k3
from rocm_k3.args import EngineArgs
from rocm_k3.cache.errors import RequestTooLargeError
from rocm_k3.engine.async_llm import AsyncLLM, EngineDeadError
from rocm_k3.engine.assembly import assemble_engine
from rocm_k3.sampling_params import SamplingParams
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

ROOT = Path(__file__).resolve().parents[2]
ARGS = EngineArgs(dtype="float32", max_model_len=512)
TIMEOUT = 60


@pytest.fixture(scope="module")
def llm():
    return rocm_k3.LLM(dtype="float32", max_model_len=512)


@pytest.fixture
def engine():
    core = assemble_engine(ARGS).core
    eng = AsyncLLM(core)
    yield eng
    eng.shutdown()


def _requests(llm):
    tok = llm.tokenizer
    out = []
    for i in range(8):
        params = (SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(temperature=0.8, seed=i, max_tokens=4 + i, ignore_eos=True))
        out.append((f"r{i}", tok.encode(f"prompt {i} " * (1 + i)), params))
    return out


async def _collect(engine: AsyncLLM, rid, prompt, params) -> list[int]:
    ids: list[int] = []
    async for delta in engine.generate(prompt, params, rid):
        ids += delta.new_token_ids
    return ids


async def _until_idle(engine: AsyncLLM) -> dict:
    for _ in range(TIMEOUT * 20):
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and engine.num_streams == 0:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine did not become idle: {engine.stats()}")


def test_concurrent_requests_get_the_tokens_they_get_alone(llm, engine) -> None:
    requests = _requests(llm)
    alone = [llm.generate(p, s)[0].token_ids for _, p, s in requests]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(_collect(engine, *r) for r in requests)), TIMEOUT)

    assert asyncio.run(main()) == alone
    assert engine.stats()["steps"] > 0


def test_closing_or_cancelling_a_stream_aborts_its_request(llm, engine) -> None:
    tok = llm.tokenizer
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def leave_early(rid: str) -> int:
        n = 0
        async for delta in engine.generate(tok.encode("long one"), long, rid):
            n += len(delta.new_token_ids)
            if n >= 3:
                break  # closing the generator aborts the request
        return n

    async def cancelled(rid: str) -> None:
        stream = await engine.add_request(rid, tok.encode("another long one"), long)

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stream.closed and not stream.finished

    async def main():
        others = asyncio.gather(*(_collect(engine, f"s{i}", tok.encode(f"short {i}"), short) for i in range(3)))
        n, _, rest = await asyncio.wait_for(asyncio.gather(leave_early("a"), cancelled("b"), others), TIMEOUT)
        stats = await _until_idle(engine)
        return n, rest, stats

    n, rest, stats = asyncio.run(main())
    assert n >= 3 and all(len(r) == 6 for r in rest)
    assert stats["free_blocks"] == stats["num_blocks"] and stats["free_state_slots"] == stats["num_state_slots"]
    assert stats["steps"] < 200  # the two 400-token requests did not run to the end


def test_bad_requests_fail_at_add_and_the_engine_keeps_serving(llm, engine) -> None:
    tok = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        with pytest.raises(RequestTooLargeError, match="max_model_len=512"):
            await engine.add_request("too-long", [1] * 600, params)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request("oov", [10**6], params)
        stream = await engine.add_request("dup", tok.encode("x"), params)
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup", tok.encode("x"), params)
        first = [t async for d in stream for t in d.new_token_ids]
        again = await _collect(engine, "dup", tok.encode("x"), params)  # a finished id may be reused
        return first, again

    first, again = asyncio.run(main())
    assert first == again == llm.generate("x", params)[0].token_ids
    assert not engine.is_dead


def test_an_engine_failure_fails_in_flight_requests_and_refuses_new_ones(llm, engine) -> None:
    tok = llm.tokenizer
    executor = engine.core.executor
    real = executor.execute
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost (injected)")
        return real(step)

    executor.execute = flaky
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        results = await asyncio.wait_for(asyncio.gather(
            *(_collect(engine, f"r{i}", tok.encode(f"p{i}"), long) for i in range(3)), return_exceptions=True),
            TIMEOUT)
        with pytest.raises(EngineDeadError, match="device lost"):
            await engine.add_request("late", tok.encode("x"), long)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results), results
    assert engine.is_dead and "device lost" in engine.dead_reason


def test_shutdown_fails_open_streams(llm) -> None:
    core = assemble_engine(ARGS).core
    engine = AsyncLLM(core)
    tok = llm.tokenizer

    async def main():
        stream = await engine.add_request("r", tok.encode("x"), SamplingParams(max_tokens=400, ignore_eos=True))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert engine.is_dead


def test_the_async_front_imports_no_tensor_code() -> None:
    code = ("import sys\nimport rocm_k3.engine.async_llm\n"
            "bad = [m for m in ('torch', 'rocm_k3.model', 'rocm_k3.worker.worker') if m in sys.modules]\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
