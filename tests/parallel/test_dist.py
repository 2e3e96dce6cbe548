"""dist tier: tensor, expert and pipeline parallelism as real processes over torch.distributed (gloo on the CPU).

Every layout must give greedy tokens identical to one process in fp32, prefix caching on: on a tiny K3 (all layer
kinds, MXFP4 LatentMoE, AttnRes; 4 KDA / MLA heads so that TP=4 divides them) and on a tiny Kimi Linear
checkpoint written by transformers (bf16 experts, plain residual, no latent); image prompts at TP=2 (the vision
tower data-parallel over the TP ranks, embeddings all-gathered). Also: a two-node run simulated with
two launcher processes on localhost, a killed worker ending the run with a named error in bounded time, the
bytes each rank read shrinking with TP, and the collectives each decoder layer issues.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rocm_k3.distributed.context import LayoutError
from rocm_k3.engine.llm import LLM
from rocm_k3.executor.multiproc import WorkerDiedError
from rocm_k3.model.tiny import EMBEDDED_DIR, write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from tests.model_fixtures import write_kimi_linear_checkpoint
from tests.vision_engine_fixtures import noise_image

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 58)), [100] * 20 + [3, 1, 4]]  # the last two share a prefix
TP4_K3 = {"num_attention_heads": 4, "moe_intermediate_size": 128, "intermediate_size": 128,
          "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                 "use_full_rank_gate": True, "full_attn_layers": [3, 6], "kda_layers": [1, 2, 4, 5]}}
TP4_KIMI_LINEAR = {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                   "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4,
                                          "full_attn_layers": [2, 5], "kda_layers": [1, 3, 4]}}
LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "tp4": {"tensor_parallel_size": 4},
           "tp2-ep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
           "pp2": {"pipeline_parallel_size": 2}}
ENGINE = {"dtype": "float32", "block_size": 16, "match_unit": 8, "alignment": 16, "max_num_batched_tokens": 64,
          "max_num_seqs": 4, "max_model_len": 128, "distributed_timeout": 120.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dist_k3"), seed=3, text_overrides=TP4_K3)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dist_kimi_linear")
    write_kimi_linear_checkpoint(path, seed=4, **TP4_KIMI_LINEAR)
    return path


def _generate(path: Path, **layout) -> tuple[list[list[int]], list[dict], dict]:
    llm = LLM(path, master_port=free_port(), **ENGINE, **layout)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        again = llm.generate(PROMPTS[2:], GREEDY)  # a prefix-cache hit on every rank
        assert again[0].token_ids == outs[2].token_ids
        return [o.token_ids for o in outs], llm.engine.executor.rank_stats(), llm.stats()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def k3_single(k3) -> tuple[list[list[int]], list[dict], dict]:
    return _generate(k3)


@pytest.fixture(scope="module")
def kimi_linear_single(kimi_linear):
    return _generate(kimi_linear)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_tiny_k3_layouts_match_one_process(k3, k3_single, layout) -> None:
    tokens, ranks, stats = _generate(k3, **LAYOUTS[layout])
    assert tokens == k3_single[0]
    assert stats["hit_tokens"] > 0, stats
    single_bytes = k3_single[1][0]["loaded_bytes"]
    if "tensor_parallel_size" in LAYOUTS[layout]:  # every TP rank reads only its slices
        assert all(r["loaded_bytes"] < single_bytes for r in ranks), (single_bytes, ranks)
    else:  # each pipeline stage reads its layers (the embedding / LM head on the first / last)
        assert sum(r["loaded_bytes"] for r in ranks) == pytest.approx(single_bytes, rel=0.02), (single_bytes, ranks)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_kimi_linear_layouts_match_one_process(kimi_linear, kimi_linear_single, layout) -> None:
    tokens, _, _ = _generate(kimi_linear, **LAYOUTS[layout])
    assert tokens == kimi_linear_single[0]


SPLIT_KIMI_LINEAR = {"num_hidden_layers": 4, "linear_attn_config": {"num_heads": 2, "head_dim": 32,
                                                                      "short_conv_kernel_size": 4,
                                                                      "full_attn_layers": [3, 4], "kda_layers": [1, 2]}}


def test_pp2_stages_owning_one_layer_kind(tmp_path_factory) -> None:
    """Kimi Linear written by transformers with KDA layers 1-2 and MLA layers 3-4: at PP=2 stage 0 owns no MLA
    layer and stage 1 no KDA layer. Both stages share one cache geometry (the largest page / slot any stage
    needs, so no stage is handed more blocks than it can hold; this once asked for a 9.9 TB MLA pool) and each
    allocates pools only for its own layer kinds; the tokens equal one process's, also at TP2 x PP2 with EP."""
    path = tmp_path_factory.mktemp("dist_kl_split")
    write_kimi_linear_checkpoint(path, seed=4, **SPLIT_KIMI_LINEAR)
    single, _, _ = _generate(path)
    tokens, _, _ = _generate(path, pipeline_parallel_size=2)
    assert tokens == single
    tokens, ranks, _ = _generate(path, pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert tokens == single  # TP2 x PP2 with expert-parallel dispatch on the same split
    assert all(0 < r["collectives"]["moe_rows"] < r["collectives"]["moe_picks"] for r in ranks), ranks


TRAINED_PROMPTS = ["The file", "Return the number of", "If the value is"]  # text the trained model knows


def _trained_tokens(**layout) -> list[list[int]]:
    llm = LLM(EMBEDDED_DIR, master_port=free_port(), **ENGINE, **layout)
    try:
        return [o.token_ids for o in llm.generate(TRAINED_PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def trained_single() -> list[list[int]]:
    return _trained_tokens()


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_trained_embedded_model_layouts_match_one_process(trained_single, layout) -> None:
    """The trained embedded model (peaked logits, not the random models' near-ties): TP and PP ranks give the
    single process's greedy tokens (EP: the next test)."""
    assert _trained_tokens(**LAYOUTS[layout]) == trained_single


@pytest.mark.parametrize("mode", ["static", "dynamic", "auto"])
def test_trained_embedded_model_ep_decode_dispatch_matches_one_process(trained_single, mode) -> None:
    """TP2 + EP on the trained embedded model: decode steps on the static-capacity dispatch (what decode graphs
    capture) and on the dynamic one (the prefill's) give the single process's greedy tokens, and each rank's
    counters show which path its decode steps took (``auto``, the default, takes the static path only inside
    decode graphs: on the CPU every step is eager, so dynamic)."""
    llm = LLM(EMBEDDED_DIR, master_port=free_port(), **ENGINE, **LAYOUTS["tp2-ep"], ep_decode_dispatch=mode)
    try:
        tokens = [o.token_ids for o in llm.generate(TRAINED_PROMPTS, GREEDY)]
        ranks = llm.engine.executor.rank_stats()
    finally:
        llm.shutdown()
    assert tokens == trained_single
    for r in ranks:
        c = r["collectives"]
        assert c["moe_dispatch_counts"] > 0, c  # the prefill steps: the dynamic path
        if mode == "static":
            assert c["moe_dispatch_static"] > 0 and c["moe_capacity_rows"] > 0, c
        else:
            assert "moe_dispatch_static" not in c, c


def test_redundant_experts_and_a_recorded_placement_change_no_token(k3, k3_single, tmp_path) -> None:
    """TP2 + EP with 2 redundant experts (10 physical slots for 8 experts, replicas of one expert on distinct
    ranks): the picks spread over the replicas and the tokens stay the single process's. The loads the EP ranks
    recorded become a placement (``rocm-k3 expert-placement``) that a second run loads, again token-identical."""
    ep = {"tensor_parallel_size": 2, "enable_expert_parallel": True, "num_redundant_experts": 2}
    llm = LLM(k3, master_port=free_port(), **ENGINE, **ep)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == k3_single[0]
        loads = llm.expert_loads()
        ranks = llm.engine.executor.rank_stats()
    finally:
        llm.shutdown()
    cfg = json.loads((k3 / "config.json").read_text())["text_config"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert len(loads) == moe_layers and all(len(v) == cfg["num_experts"] for v in loads.values()), loads
    picks = {sum(v) for v in loads.values()}
    assert len(picks) == 1 and picks.pop() % cfg["num_experts_per_token"] == 0
    for r in ranks:  # each rank ran about half of the picks, never all of them
        c = r["collectives"]
        assert 0 < c["moe_rows"] < c["moe_picks"], c
    (tmp_path / "loads.json").write_text(json.dumps({"layers": loads}))
    placement = tmp_path / "placement.json"
    from rocm_k3.cli import main

    assert main(["expert-placement", str(tmp_path / "loads.json"), "--ep-size", "2", "--num-redundant-experts", "2",
                 "-o", str(placement)]) == 0
    tokens, _, _ = _generate(k3, expert_placement=str(placement), **ep)
    assert tokens == k3_single[0]


def test_server_metrics_show_expert_loads_under_ep(k3) -> None:
    """``rocm-k3 serve`` at TP2 + EP: after a completion /metrics has a per-expert load counter for every MoE
    layer whose picks sum to k per token run."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from rocm_k3.args import EngineArgs
    from tests.server_fixtures import running_server

    args = EngineArgs(model=str(k3), master_port=free_port(), tensor_parallel_size=2, enable_expert_parallel=True,
                      **ENGINE)
    with running_server(args) as server:
        out = server.client().completions.create(model=server.served.names[0], prompt=[5, 6, 7, 8], max_tokens=3,
                                                 temperature=0)
        assert out.usage.completion_tokens == 3
        with urllib.request.urlopen(server.url("/metrics"), timeout=60) as resp:
            text = resp.read().decode()
    per_layer: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "rocm_k3_expert_load":
            for sample in family.samples:
                per_layer[sample.labels["layer"]] = per_layer.get(sample.labels["layer"], 0) + sample.value
    cfg = json.loads((k3 / "config.json").read_text())["text_config"]
    assert len(per_layer) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"], text
    tokens_run = 4 + 2  # the prompt, then one decode step per token after the first
    assert set(per_layer.values()) == {tokens_run * cfg["num_experts_per_token"]}, per_layer


def test_bytes_per_rank_shrink_as_tp_grows(k3, k3_single) -> None:
    per_rank = {1: k3_single[1][0]["loaded_bytes"]}
    for tp in (2, 4):
        _, ranks, _ = _generate(k3, tensor_parallel_size=tp)
        assert len({r["loaded_bytes"] for r in ranks}) == 1  # every rank reads an equal share
        per_rank[tp] = ranks[0]["loaded_bytes"]
    print("bytes loaded per rank by TP size:", per_rank)
    assert per_rank[4] < per_rank[2] < per_rank[1]


def test_collectives_per_decoder_layer(k3) -> None:
    """One step through all six layers at TP=2: one all-reduce after each attention / KDA sublayer, two per
    LatentMoE layer (latent, then the hidden-size sum), one for the dense layer 0, plus the embedding's; the LM
    head gathers nothing (vocab-parallel sampling: two small sampler collectives for a greedy step)."""
    llm = LLM(k3, master_port=free_port(), tensor_parallel_size=2, **ENGINE)
    try:
        llm.engine.executor.rank_stats(reset=True)
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1))  # one prefill step
        ranks = llm.engine.executor.rank_stats()
    finally:
        llm.shutdown()
    cfg = json.loads((k3 / "config.json").read_text())["text_config"]
    layers = cfg["num_hidden_layers"]
    moe_layers = layers - cfg["first_k_dense_replace"]
    for r in ranks:
        c = r["collectives"]
        assert c["all_reduce"] == layers + 1, c  # attention / KDA o_proj per layer + the dense MLP of layer 0
        assert c["moe_latent_all_reduce"] == moe_layers and c["moe_all_reduce"] == moe_layers, c
        assert c["embedding_all_reduce"] == 1 and "lm_head_all_gather" not in c, c
        assert c["sampler_all_reduce"] == 1 and c["sampler_all_gather"] == 1, c  # flags, then the max + its id
        per_moe_layer = (c["moe_latent_all_reduce"] + c["moe_all_reduce"]) / moe_layers
        assert per_moe_layer <= 2


def test_tp2_images_run_the_tower_data_parallel(tmp_path_factory) -> None:
    """Two images of 16 and 18 tokens in one step are split over the 2 TP ranks (one each, rows padded for the
    gather) and gathered: the tokens equal one process's, and an identical image prompt hits the cache."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("dist_vision"), seed=5, text_overrides=TP4_K3, vision=True)
    marker = "<|kimi_image_placeholder|>"
    prompts = [{"prompt": f"one {marker} two {marker}",
                "multi_modal_data": {"image": [noise_image(1, 100, 90), noise_image(2, 60, 150)]}},
               {"prompt": "three", "multi_modal_data": {"image": noise_image(3, 40, 40)}}]
    single = LLM(path, **ENGINE)
    expected = [o.token_ids for o in single.generate(prompts, GREEDY)]
    llm = LLM(path, master_port=free_port(), tensor_parallel_size=2, **ENGINE)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        again = llm.generate(prompts[:1], GREEDY)[0]
        assert again.token_ids == expected[0] and again.num_cached_tokens > 60
        ranks = llm.engine.executor.rank_stats()
    finally:
        llm.shutdown()
    assert all(r["collectives"].get("vision_all_gather", 0) >= 2 for r in ranks), ranks


def test_impossible_layouts_are_named(k3, kimi_linear) -> None:
    with pytest.raises(LayoutError, match="KDA heads"):
        LLM(k3, tensor_parallel_size=8, **ENGINE)
    with pytest.raises(LayoutError, match="num_experts"):
        LLM(kimi_linear, tensor_parallel_size=16, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(LayoutError, match="nnodes"):
        LLM(k3, tensor_parallel_size=2, nnodes=3, **ENGINE)
    with pytest.raises(LayoutError, match="exceeds"):
        LLM(k3, pipeline_parallel_size=7, **ENGINE)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rocm_k3.cli", "generate", *args]


def test_two_nodes_on_localhost_give_the_same_tokens(k3, k3_single) -> None:
    """TP=2 inside each 'node', PP=2 across them: node 0 generates, node 1 runs its ranks headless."""
    port = free_port()
    common = ["--model", str(k3), "--token-ids", "--show-ids", "--max-tokens", "6", "--dtype", "float32",
              "-tp", "2", "-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--distributed-timeout", "120", ",".join(map(str, PROMPTS[0]))]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    node1 = subprocess.Popen(_cli(*common, "--node-rank", "1"), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        node0 = subprocess.run(_cli(*common, "--node-rank", "0"), env=env, capture_output=True, text=True,
                               timeout=300)
        assert node0.returncode == 0, node0.stderr
        assert f"token ids: {k3_single[0][0]}" in node0.stdout, node0.stdout
        assert node1.wait(timeout=60) == 0, node1.stderr.read()
    finally:
        if node1.poll() is None:
            node1.kill()


def test_a_killed_worker_ends_the_run_with_a_named_error(k3) -> None:
    llm = LLM(k3, master_port=free_port(), tensor_parallel_size=2, **ENGINE)
    victim = next(p for rank, p in llm.engine.executor._procs if rank == 1)
    killer = threading.Timer(3.0, lambda: os.kill(victim.pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match="rank 1"):
            for _ in range(50):  # bounded: far longer than the kill delay
                llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    finally:
        killer.cancel()
        llm.shutdown()
    assert time.monotonic() - start < 120
    assert all(not p.is_alive() for _, p in llm.engine.executor._procs)
