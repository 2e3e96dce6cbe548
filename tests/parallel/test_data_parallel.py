"""dist tier: DP attention with expert-parallel MoE (``data_parallel_size=2``, TP1 per replica) over gloo.

Two replicas, each with its own scheduler and cache, share one EP group of 2 ranks (4 of the 8 experts each). The
greedy tokens of a batch spread over both replicas equal one process's, on the trained embedded K3 and on a Kimi
Linear checkpoint written by transformers; every routed pick runs exactly once, on the rank owning its expert; a
replica without work sits steps out with zero tokens through its MoE layers (serving the other's rows, no hang);
DP2 x TP2 (EP over 4 ranks) gives the same tokens;
aborted and finished requests leave every block and slot free; ``rocm-k3 serve --data-parallel-size 2`` serves;
impossible settings are named before any process starts. (Routed rows per rank = T x k / 2 on a balanced batch:
tests/parallel/test_expert_dispatch.py.)
"""

from __future__ import annotations

import concurrent.futures
import socket

import pytest

from rocm_k3.distributed.context import LayoutError
from rocm_k3.engine.dp_engine import DataParallelEngine
from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.structured import StructuredOutputs
from rocm_k3.worker.step_io import StepInput
from tests.model_fixtures import write_kimi_linear_checkpoint

pytestmark = pytest.mark.dist
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The file", "Return the number of", "If the value is", "The file is"]  # the last shares a prefix
LONE = "Return the value"
ENGINE = {"dtype": "float32", "block_size": 16, "match_unit": 8, "alignment": 16, "max_num_batched_tokens": 64,
          "max_num_seqs": 4, "max_model_len": 128, "distributed_timeout": 60.0}
DP2 = {"data_parallel_size": 2, "enable_expert_parallel": True}
MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
        "additionalProperties": False}
MIXED = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1),
         SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputs(json=MOOD),
                        skip_special_tokens=False)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp1() -> dict:
    llm = LLM(EMBEDDED_DIR, **ENGINE)
    return {"batch": [o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
            "lone": llm.generate(LONE, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids,
            "text": [o.text for o in llm.generate([[5, 6, 7, 8], [9, 10, 11]], GREEDY)],
            "mixed": llm.generate(PROMPTS[:2], MIXED)}


@pytest.fixture(scope="module")
def dp2():
    llm = LLM(EMBEDDED_DIR, master_port=free_port(), **ENGINE, **DP2)
    yield llm
    llm.shutdown()


def test_dp2_ep_batch_matches_tp1(dp2, tp1) -> None:
    assert isinstance(dp2.engine, DataParallelEngine)
    dp2.engine.executor.rank_stats(reset=True)
    assert [o.token_ids for o in dp2.generate(PROMPTS, GREEDY)] == tp1["batch"]
    ranks = dp2.engine.executor.rank_stats()
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    c = [r["collectives"] for r in ranks]
    assert all(x["moe_picks"] > 0 for x in c), c  # the batch was spread over both replicas
    assert sum(x["moe_rows"] for x in c) == sum(x["moe_picks"] for x in c), c  # every pick ran once, where it lives
    assert all(0 < x["moe_rows"] < sum(y["moe_picks"] for y in c) for x in c), c  # never all of them on one rank
    again = dp2.generate(PROMPTS[3:], GREEDY)[0]  # a prefix-cache hit inside its replica
    assert again.token_ids == tp1["batch"][3]
    stats = dp2.stats()
    assert stats["hit_tokens"] > 0 and stats["data_parallel_size"] == 2, stats
    loads = dp2.expert_loads()
    assert loads and all(len(v) == 8 for v in loads.values()), loads
    with pytest.raises(ValueError, match="execute_replicas"):  # one step for every replica would hang their outputs
        dp2.engine.executor.execute(StepInput(step_id=10**6))


def test_logprobs_and_structured_output_on_the_replicas(dp2, tp1) -> None:
    """One request per replica: logprobs and prompt logprobs as one process's, a JSON-schema grammar holds."""
    got = dp2.generate(PROMPTS[:2], MIXED)
    want = tp1["mixed"]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    pairs = [*zip(got[0].logprobs, want[0].logprobs), *zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:])]
    assert len(pairs) == 6 + len(got[0].prompt_token_ids) - 1
    for g, w in pairs:
        assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g), (g, w)
    assert got[1].text == want[1].text and '"mood"' in got[1].text, got[1]  # the grammar shaped it


def test_an_idle_replica_sits_out_while_the_other_decodes(dp2, tp1) -> None:
    dp2.engine.executor.rank_stats(reset=True)
    out = dp2.generate(LONE, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == tp1["lone"]
    busy, idle = sorted(dp2.engine.executor.rank_stats(), key=lambda r: r["idle_steps"])
    steps = idle["idle_steps"]
    assert busy["idle_steps"] == 0 and steps >= 8, (busy, idle)  # a prefill and the decodes, all sat out
    assert idle["collectives"].get("moe_picks", 0) == 0 and idle["collectives"]["moe_rows"] > 0, idle
    assert idle["collectives"]["moe_combine"] == busy["collectives"]["moe_combine"], (busy, idle)
    # the idle replica's finished batch requests were dropped on its rank while it sat out; the busy one keeps only
    # the request it just finished (told with its next step)
    assert (idle["known_requests"], idle["request_rows"]) == (0, 0), idle
    assert (busy["known_requests"], busy["request_rows"]) == (1, 1), busy


def test_abort_and_finish_leave_nothing(dp2, tp1) -> None:
    engine = dp2.engine
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", dp2.tokenizer.encode(prompt), GREEDY if i < 2 else long)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r1", [5, 6], GREEDY)  # ids are unique over the replicas
    assert {engine.replica_of(f"r{i}") for i in range(4)} == {0, 1}
    for _ in range(3):
        engine.step()
    assert engine.abort("r2") and engine.abort("r3") and not engine.abort("r2")
    done = engine.run_to_completion()
    assert sorted(done) == ["r0", "r1"]
    assert [done[f"r{i}"].token_ids for i in range(2)] == tp1["batch"][:2]
    for core in engine.cores:
        s = core.stats()
        assert (s["running"], s["waiting"]) == (0, 0), s
        assert s["free_blocks"] == s["num_blocks"] and s["free_state_slots"] == s["num_state_slots"], s
    assert not engine.has_unfinished()


def test_async_engine_streams_over_the_replicas(dp2, tp1) -> None:
    """The server's way in (AsyncLLM over the DataParallelEngine): two concurrent streams, one per replica, give
    one process's greedy text (``rocm-k3 serve`` itself: the slow test below)."""
    import asyncio

    from rocm_k3.engine.async_llm import AsyncLLM

    engine = AsyncLLM(dp2.engine)

    async def text(rid: str, ids: list[int]) -> str:
        return "".join([d.new_text async for d in engine.generate(ids, GREEDY, rid)])

    async def both() -> list[str]:
        return await asyncio.gather(text("a", [5, 6, 7, 8]), text("b", [9, 10, 11]))

    try:
        assert asyncio.run(asyncio.wait_for(both(), 120)) == tp1["text"]
    finally:
        engine.shutdown()  # joins the engine thread: the core is the test's again
    stats = dp2.engine.stats()
    assert [stats[f"replica{d}_{k}"] for d in (0, 1) for k in ("running", "waiting")] == [0] * 4, stats


def test_cli_takes_data_parallel_size() -> None:
    import argparse

    from rocm_k3.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli(parser.parse_args(["-dp", "2", "--enable-expert-parallel"]))
    assert args.parallel_config().data_parallel_size == 2 and args.parallel_config().world_size == 2


@pytest.mark.slow
def test_dp2_x_tp2_ep4_matches_tp1(tp1) -> None:
    """Four ranks: two replicas of TP2 (tokens split over a replica's TP ranks for the dispatch, the TP
    all-reduces inside each replica), one EP group of 4 ranks with 2 experts each."""
    llm = LLM(EMBEDDED_DIR, master_port=free_port(), tensor_parallel_size=2, **ENGINE, **DP2)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tp1["batch"]
        ranks = llm.engine.executor.rank_stats()
    finally:
        llm.shutdown()
    assert [(r["dp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    picks = ranks[0]["collectives"]["moe_picks"] + ranks[2]["collectives"]["moe_picks"]  # per replica, all TP ranks
    assert sum(r["collectives"]["moe_rows"] for r in ranks) == picks, ranks  # each pick once over the 4 ranks


@pytest.mark.slow
def test_kimi_linear_dp2_ep_matches_tp1(tmp_path) -> None:
    write_kimi_linear_checkpoint(tmp_path, seed=4)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 58)), [100] * 20 + [3, 1, 4]]
    single = [o.token_ids for o in LLM(tmp_path, **ENGINE).generate(prompts, GREEDY)]
    llm = LLM(tmp_path, master_port=free_port(), **ENGINE, **DP2)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == single
        assert all(r["collectives"]["moe_picks"] > 0 for r in llm.engine.executor.rank_stats())
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_serve_with_data_parallel_size_2(tmp_path, tp1) -> None:
    """``rocm-k3 serve --data-parallel-size 2 --enable-expert-parallel``: two concurrent requests (one streamed)
    give one process's greedy text."""
    import openai

    from tests.server_fixtures import serve_subprocess

    flags = ["--data-parallel-size", "2", "--enable-expert-parallel", "--dtype", "float32", "--max-model-len", "128",
             "--max-num-batched-tokens", "64", "--alignment", "16", "--block-size", "16", "--match-unit", "8",
             "--max-num-seqs", "4", "--master-port", str(free_port()), "--distributed-timeout", "60"]
    with serve_subprocess(tmp_path, *flags) as (port, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def plain() -> str:
            return client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0).choices[0].text

        def streamed() -> str:
            chunks = client.completions.create(model=model, prompt=[9, 10, 11], max_tokens=6, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = [f.result(timeout=120) for f in [pool.submit(plain), pool.submit(streamed)]]
    assert texts == tp1["text"]


def test_impossible_dp_settings_are_named(tmp_path) -> None:
    with pytest.raises(LayoutError, match="needs enable_expert_parallel"):
        LLM(EMBEDDED_DIR, data_parallel_size=2, **ENGINE)
    with pytest.raises(LayoutError, match="num_experts .* does not split over 3 ranks"):  # 8 experts, DP3 x TP1
        LLM(EMBEDDED_DIR, data_parallel_size=3, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(LayoutError, match="pipeline_parallel_size 1"):
        LLM(EMBEDDED_DIR, data_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(LayoutError, match="data_parallel_size"):
        LLM(EMBEDDED_DIR, data_parallel_size=0, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(LayoutError, match="ep_decode_dispatch='static' with data_parallel_size=2"):  # not ignored
        LLM(EMBEDDED_DIR, ep_decode_dispatch="static", **ENGINE, **DP2)
    with pytest.raises(ValueError, match="data_parallel_size 1"):
        LLM(EMBEDDED_DIR, kv_transfer_config={"kv_connector": "SocketConnector", "kv_role": "kv_producer",
                                              "kv_port": free_port()}, **ENGINE, **DP2)
