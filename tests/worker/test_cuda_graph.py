"""Decode graphs: bucketing, padding and buffer reuse on the CPU (the plumbing), and on the H200 (cuda tier)
identical greedy tokens with graphs and eagerly, fp32 and bf16, on the tiny model and a K3-shaped slice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from rocm_k3.engine.llm import LLM
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.cuda_graph import DecodeGraphs, graph_buckets
from rocm_k3.worker.kv_pools import PoolShapes, KVPools
from rocm_k3.worker.model_runner import ModelRunner, PreviousTokens
from rocm_k3.worker.stage_link import StateBuffers, state_parts
from rocm_k3.worker.step_io import PLACEHOLDER_TOKEN, ScheduledChunk, StepInput

GEOM = PoolShapes(num_mla_layers=1, num_kda_layers=1, kda_heads=2, kda_head_dim=8, conv_width=4,
                     dtype=torch.float32)


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_buckets(0)


def _decode_step(step_id: int, rows: list[tuple[str, int, int, tuple[int, ...], int]]) -> StepInput:
    """rows: (request id, token, start, new block ids, kda slot); all admitted decodes (start > 0)."""
    chunks = tuple(ScheduledChunk(rid, (tok,), start, True, blocks, slot, False, True)
                   for rid, tok, start, blocks, slot in rows)
    return StepInput(step_id=step_id, chunks=chunks, num_decodes=len(chunks))


def test_fill_pads_rows_into_the_scratch_block_and_slot_and_reuses_buffers() -> None:
    pools = KVPools(GEOM, block_size=4, num_blocks=10, num_slots=6)
    graphs = DecodeGraphs(model=None, pools=pools, width=5, buckets=[1, 2, 4, 8])
    runner = ModelRunner(None, pools, max_blocks_per_seq=5)
    step = _decode_step(1, [("a", 11, 5, (3, 7), 2), ("b", 12, 2, (4,), 5), ("c", 13, 9, (0, 1, 2), 1)])
    runner.apply_deltas(step)
    plan = runner.plan(step)
    assert plan.is_decode
    assert graphs.bucket_for(3) == 4 and graphs.bucket_for(8) == 8 and graphs.bucket_for(9) is None
    buffers = [graphs.input_ids.data_ptr(), graphs.block_table.data_ptr()]
    graphs.fill(plan, 4)
    assert graphs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert graphs.positions[:4].tolist() == [5, 2, 9, 0]
    assert graphs.seq_lens[:4].tolist() == [6, 3, 10, 1]  # the padded row reads one scratch token
    pad = pools.pad_block * 4
    assert graphs.slot_mapping[:4].tolist() == [7 * 4 + 1, 4 * 4 + 2, 2 * 4 + 1, pad]
    assert graphs.kda_slots[:4].tolist() == [2, 5, 1, pools.pad_slot]
    assert graphs.block_table[0, :2].tolist() == [3, 7] and graphs.block_table[2, :3].tolist() == [0, 1, 2]
    assert graphs.block_table[3, 0] == pools.pad_block
    batch = graphs.batch(4)
    assert batch.is_decode and batch.num_seqs == 4 and batch.cu_seqlens.tolist() == [0, 1, 2, 3, 4]
    # a smaller step reuses the same buffers; its former rows become padding
    small = _decode_step(2, [("d", 21, 1, (9,), 3)])
    runner.apply_deltas(small)
    graphs.fill(runner.plan(small), 2)
    assert graphs.input_ids[:2].tolist() == [21, 0] and graphs.kda_slots[:2].tolist() == [3, pools.pad_slot]
    assert [graphs.input_ids.data_ptr(), graphs.block_table.data_ptr()] == buffers
    with pytest.raises(ValueError, match="do not fit"):
        graphs.fill(plan, 2)
    wide = dataclasses.replace(runner.plan(small), block_table=np.zeros((1, 6), dtype=np.int32))
    with pytest.raises(ValueError, match="graph width"):
        graphs.fill(wide, 2)


def test_graph_run_falls_back_when_no_bucket_is_captured() -> None:
    pools = KVPools(GEOM, block_size=4, num_blocks=4, num_slots=2)
    graphs = DecodeGraphs(model=None, pools=pools, width=2, buckets=[1, 2])
    runner = ModelRunner(None, pools, max_blocks_per_seq=2)
    runner.graphs = graphs
    step = _decode_step(1, [("a", 1, 1, (0,), 0)])
    runner.apply_deltas(step)
    assert graphs.captured == [] and graphs.key_for(1) is None
    with pytest.raises(AttributeError):  # the eager forward: the runner's model (None here) runs the step
        runner._forward(step, pools)


class _Recorded:
    """A captured graph stand-in: its replay records the input ids it would read."""

    def __init__(self, graphs: DecodeGraphs, seen: list) -> None:
        self.graphs, self.seen = graphs, seen

    def replay(self) -> None:
        self.seen.append(self.graphs.input_ids[:4].tolist())


def test_graph_run_takes_the_previous_steps_tokens_after_the_fill() -> None:
    """Asynchronous scheduling: a ``from_previous`` decode's input is the previous step's sample for its request,
    written into the graph's input buffer after the fill and before the replay (in order: one copy; else indexed)."""
    pools = KVPools(GEOM, block_size=4, num_blocks=10, num_slots=6)
    graphs = DecodeGraphs(model=None, pools=pools, width=5, buckets=[1, 2, 4])
    runner = ModelRunner(None, pools, max_blocks_per_seq=5)
    runner.graphs, seen = graphs, []
    graphs._graphs[(4, 1)], graphs._out[(4, 1)], graphs._tapped[(4, 1)] = _Recorded(graphs, seen), \
        torch.zeros(4, 3), None

    def step(step_id, rows):
        chunks = tuple(ScheduledChunk(rid, (PLACEHOLDER_TOKEN if tok is None else tok,), start,
                                      rid not in runner.rows, () if rid in runner.rows else (ord(rid) - 97,),
                                      ord(rid) - 97, False, True, from_previous=tok is None)
                       for rid, tok, start in rows)
        return StepInput(step_id=step_id, chunks=chunks, num_decodes=len(chunks))

    previous = PreviousTokens(torch.tensor([70, 71, 72]), {"a": 0, "b": 1, "c": 2})
    runner.execute(step(1, [("a", None, 1), ("b", None, 2), ("c", 13, 3)]), previous)  # in order: one copy
    runner.execute(step(2, [("c", None, 2), ("d", 14, 1), ("a", None, 2)]), previous)  # reordered: indexed
    assert seen == [[70, 71, 13, 0], [72, 14, 70, 0]]
    with pytest.raises(RuntimeError, match="did not sample"):
        runner.execute(step(3, [("e", None, 1)]), previous)


# ---------------------------------------------------------------------------------------------------------- cuda
def _greedy(path, dtype: str, eager: bool, prompts, steps: int = 32):
    llm = LLM(path, dtype=dtype, backend="triton", device="cuda", enforce_eager=eager, max_num_seqs=8,
              max_model_len=1024, kv_cache_bytes=1 << 30, state_cache_bytes=1 << 30)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=0))
    graphs = llm.engine.executor.worker.runner.graphs
    return outs, (graphs.replays if graphs is not None else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_graphs_equal_eager(dtype: str) -> None:
    """fp32: three requests, so the graph replays bucket 4 with a padded row. bf16: four requests, a bucket size:
    with a padded row the GEMMs see M = 4 instead of 3 and cuBLAS may sum in another order, which in bf16 can
    flip a near-tie after ~25 steps (seen on the H200, 2026-12-01); the graph machinery itself is exact."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[5, 6, 7, 8], list(range(30, 70)), [9] * 17]
    if dtype == "bfloat16":
        prompts.append([3, 1, 4, 1, 5, 9, 2, 6])
    eager, _ = _greedy(None, dtype, True, prompts)
    graphed, replays = _greedy(None, dtype, False, prompts)
    assert replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_k3_slice_graphs_equal_eager(dtype: str, k3_slice_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    path = k3_slice_path
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(100, 164))]
    eager, _ = _greedy(path, dtype, True, prompts, steps=16)
    graphed, replays = _greedy(path, dtype, False, prompts, steps=16)
    assert replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_stage_input_buffers_are_contiguous_views_of_one_memory_per_part() -> None:
    """A later pipeline stage's graphs read their input state from one flat buffer per part: the state of n rows
    is the buffers' first elements in its shapes (contiguous, so a receive can fill it), for every n."""
    def shapes(n: int) -> list[tuple[int, ...]]:
        return [(n, 6), (n, 6), (3, n, 6)]  # running, delta, an AttnRes bank of 3 blocks

    bufs = StateBuffers(shapes, 8, torch.float32, torch.device("cpu"))
    big, small = bufs.view(8), bufs.view(3)
    for a, b, shape in zip(state_parts(big), state_parts(small), shapes(3)):
        assert b.shape == shape and b.is_contiguous() and a.data_ptr() == b.data_ptr()
    assert float(small.blocks.abs().sum()) == 0.0  # zeros before anything is received: finite padding rows
    small.blocks.fill_(1.0)
    assert float(big.blocks.sum()) == 3 * 3 * 6
    for bad in (0, 9):
        with pytest.raises(ValueError, match="rows"):
            bufs.view(bad)
