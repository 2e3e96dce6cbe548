"""cuda tier: per-stage decode graphs under pipeline parallelism (issue #32).

One GPU: both stages of a PP2 split of the trained embedded model in one process (stage 0 owns layers 0-3, stage 1
layers 4-5: the AttnRes bank crosses the boundary). Each stage captures its decode graphs (buckets 1, 2, 4); a
decode step replays stage 0's graph, copies its output state into stage 1's fixed input buffers (what the receive
does across processes) and replays stage 1's graph. Over steps of 3 (bucket 4: one padded row), 2 and 1 requests,
the graphs replayed on new inputs equal the eager stages run over the same buffers and the same cache state bit
for bit (the same kernels on the same shapes and memory), and equal the unsplit model run over the same padded
batch: fp32 (tf32 off) within 1e-5 x max |logit|, bf16 within 1e-2 x max |logit| (about two bf16 ulps at the
logits' scale), with the same greedy tokens.
Two GPUs (skipped with fewer): PP2 over NCCL with decode graphs gives the greedy tokens of the same layout run
eagerly, every rank replaying graphs, two steps in flight.
"""

from __future__ import annotations

import math
import socket

import pytest
import torch

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.engine.llm import LLM
from rocm_k3.model.attn_res import StackState
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.cuda_graph import DecodeGraphs
from rocm_k3.worker.kv_pools import KVPools, PoolShapes
from rocm_k3.worker.model_runner import ModelRunner
from rocm_k3.worker.stage_link import StageLink, state_parts
from rocm_k3.worker.step_io import ScheduledChunk, StepInput

pytestmark = pytest.mark.cuda
WIDTH, BLOCK = 4, 16  # blocks per request (64 tokens), tokens per block
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 53)), [9, 4] * 6]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DEVICE, BACKEND = "cuda", "triton"


def _pools(model, dtype: torch.dtype) -> KVPools:
    return KVPools(PoolShapes.from_model(model, dtype), block_size=BLOCK, num_blocks=4 * WIDTH, num_slots=4,
                   device=DEVICE)


def _cache_tensors(pools: KVPools) -> list[torch.Tensor]:
    s = pools.shapes
    return ([pools.mla_kv(i) for i in range(s.num_mla_layers)] + [pools.kda_state(i) for i in range(s.num_kda_layers)]
            + [pools.conv_state(i) for i in range(s.num_kda_layers)])


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    assert err <= TOL[dtype] * scale, (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pp2_stage_graphs_equal_eager_stages_and_the_unsplit_model(dtype: torch.dtype) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    path = ensure_embedded_model()
    kw = {"dtype": dtype, "device": DEVICE, "backend": BACKEND, "progress": False}
    full = load_model(path, **kw)
    ctxs = [ParallelContext(rank=r, world_size=2, pp_rank=r, pp_size=2, pp_ranks=(0, 1)) for r in (0, 1)]
    stages = [load_model(path, ctx=c, **kw) for c in ctxs]
    assert [s.layer_range for s in stages] == [range(0, 4), range(4, 6)]
    pools = [_pools(s, dtype) for s in stages]
    full_pools = _pools(full, dtype)
    runner = ModelRunner(None, full_pools, max_blocks_per_seq=WIDTH)  # plans and eager batches
    graphs = [DecodeGraphs(StageLink(s, c), p, WIDTH, [1, 2, 4]) for s, c, p in zip(stages, ctxs, pools)]
    assert graphs[0].inputs is None and graphs[1].inputs is not None  # stage 1 reads fixed input buffers
    for g in graphs:
        g.capture()
        assert g.captured == [1, 2, 4]

    # prefill, eagerly: the split and the unsplit model
    chunks = tuple(ScheduledChunk(str(i), tuple(p), 0, True, tuple(range(i * WIDTH, (i + 1) * WIDTH)), i, True, True)
                   for i, p in enumerate(PROMPTS))
    step = StepInput(step_id=0, chunks=chunks)
    runner.apply_deltas(step)
    batch = runner.batch(runner.plan(step))
    with torch.inference_mode():
        logits = stages[1].forward_stage(batch, pools[1], stages[0].forward_stage(batch, pools[0], None))
        _close(logits, full.forward(batch, full_pools), dtype)
    tokens = logits.argmax(-1).tolist()
    lengths = [len(p) for p in PROMPTS]

    for t, n in enumerate([3, 3, 3, 2, 2, 1]):  # buckets 4 (a padded row), 2, 1
        chunks = tuple(ScheduledChunk(str(i), (tokens[i],), lengths[i], False, (), i, False, True) for i in range(n))
        step = StepInput(step_id=t + 1, chunks=chunks, num_decodes=n)
        runner.apply_deltas(step)
        plan = runner.plan(step)
        key = graphs[0].key_for(n)
        assert plan.is_decode and key == graphs[1].key_for(n) == ({3: 4}.get(n, n), 1)
        for g in graphs:
            g.fill(plan, *key)
        batches = [g.batch(*key) for g in graphs]
        # the eager stages over the same buffers, from the same cache state (restored after)
        saved = [[x.clone() for x in _cache_tensors(p)] for p in pools]
        with torch.inference_mode():
            eager_state = stages[0].forward_stage(batches[0], pools[0], None)
            sent = [x.clone() for x in state_parts(eager_state)]  # stage 1 writes its bank snapshots in place
            eager_logits = stages[1].forward_stage(batches[1], pools[1], StackState(*sent))
        for p, copies in zip(pools, saved):
            for x, c in zip(_cache_tensors(p), copies):
                x.copy_(c)
        # the graphs: stage 0's output into stage 1's fixed input buffers
        out = graphs[0].launch(key)
        # the bank's blocks stage 0 wrote (the later ones are unwritten memory until stage 1 writes them)
        written = math.ceil(stages[0].layer_range.stop / full.cfg.attn_res_block_size)
        assert torch.equal(out.running, eager_state.running) and torch.equal(out.delta, eager_state.delta)
        assert torch.equal(out.blocks[:written], eager_state.blocks[:written])
        for dst, src in zip(state_parts(graphs[1].stage_input(key)), state_parts(out)):
            dst.copy_(src)
        graph_logits = graphs[1].launch(key)
        assert torch.equal(graph_logits, eager_logits), (t, (graph_logits - eager_logits).abs().max().item())
        with torch.inference_mode():
            full_logits = full.forward(batches[0], full_pools)  # the unsplit model, same padded batch
        _close(graph_logits[:n], full_logits[:n], dtype)
        tokens = graph_logits[:n].argmax(-1).tolist()
        assert tokens == full_logits[:n].argmax(-1).tolist()
        lengths = [x + 1 for x in lengths]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pp2(eager: bool):
    llm = LLM(None, dtype="float32", backend="triton", device="cuda", enforce_eager=eager, max_num_seqs=8,
              max_model_len=512, kv_cache_bytes=1 << 30, state_cache_bytes=1 << 30, pipeline_parallel_size=2,
              master_port=_free_port())
    try:
        prompts = [[5, 6, 7, 8], list(range(30, 70)), [9] * 17, [3, 1, 4, 1, 5], [2] * 9, list(range(100, 120))]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        return [o.token_ids for o in outs], llm.stats(), llm.engine.executor.rank_stats()
    finally:
        llm.shutdown()


@pytest.mark.multigpu
def test_pp2_over_nccl_with_stage_graphs_gives_the_eager_tokens() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        pytest.skip(f"multigpu tier: PP2 needs 2 GPUs, this machine has {gpus}")
    eager, _, eager_ranks = _pp2(True)
    graphed, stats, ranks = _pp2(False)
    assert graphed == eager
    assert all(r["graph_replays"] == 0 for r in eager_ranks)
    assert all(r["graph_replays"] > 0 for r in ranks) and len({r["graph_replays"] for r in ranks}) == 1, ranks
    assert stats["steps_in_flight_max"] == 2, stats
