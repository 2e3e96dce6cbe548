"""The worker side of the step contract: KVPools (sizes vs the byte budget, scratch block/slot, copy-on-write
execution), the StepInput the scheduler sends (decodes first, new requests once, block-table deltas, it pickles)
and the ModelRunner's host plan / ForwardBatch built from it."""

from __future__ import annotations

import torch

import pickle

from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.manager import CacheManager
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.scheduler import Scheduler
from rocm_k3.engine.sequence import Sequence
from rocm_k3.engine.stop import StopChecker
from rocm_k3.model.forward_batch import HybridCacheView
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.kv_pools import PoolShapes, KVPools
from rocm_k3.worker.model_runner import ModelRunner
from rocm_k3.worker.step_io import SampledToken, StepOutput
from tests.helpers import seeded

GEOM = PoolShapes(
    num_mla_layers=2, num_kda_layers=3, kda_heads=2, kda_head_dim=8, conv_width=4, dtype=torch.bfloat16,
    mla_latent_width=576,
)


def _filled_cache(num_blocks: int = 6, num_slots: int = 4, block_size: int = 4) -> KVPools:
    cache = KVPools(GEOM, block_size=block_size, num_blocks=num_blocks, num_slots=num_slots)
    gen = seeded(0)
    for i in range(GEOM.num_mla_layers):
        cache.mla_kv(i).copy_(torch.randn(cache.mla_kv(i).shape, generator=gen))
    for i in range(GEOM.num_kda_layers):
        cache.kda_state(i).copy_(torch.randn(cache.kda_state(i).shape, generator=gen))
        cache.conv_state(i).copy_(torch.randn(cache.conv_state(i).shape, generator=gen))
    return cache


def test_tensor_sizes_match_byte_accounting():
    cache = KVPools(GEOM, block_size=16, num_blocks=5, num_slots=3)
    assert isinstance(cache, HybridCacheView)
    kv = sum(cache.mla_kv(i).nbytes for i in range(2))
    states = sum(cache.kda_state(i).nbytes + cache.conv_state(i).nbytes for i in range(3))
    # + one scratch block and one scratch slot for padded decode-graph rows
    assert kv == 6 * GEOM.bytes_per_block(16) and states == 4 * GEOM.bytes_per_slot()
    assert cache.mla_kv(0).shape == (6, 16, 576) and cache.kda_state(2).shape == (4, 2, 8, 8)
    assert cache.kda_state(0).dtype == torch.float32 and cache.conv_state(0).shape == (4, 48, 3)
    assert (cache.pad_block, cache.pad_slot) == (5, 3)
    kv, states = 5 * GEOM.bytes_per_block(16), 3 * GEOM.bytes_per_slot()
    num_blocks, num_slots = CacheConfig(
        block_size=16, match_unit=16, alignment=16, kda_save_grid=16, kv_cache_bytes=kv, state_cache_bytes=states
    ).resolve(bytes_per_block=GEOM.bytes_per_block(16), bytes_per_slot=GEOM.bytes_per_slot(), max_model_len=64)
    assert (num_blocks, num_slots) == (5, 3)


def test_apply_copies_copies_prefix_rows_and_whole_states():
    cache = _filled_cache()
    before_kv = [cache.mla_kv(i).clone() for i in range(2)]
    before_st = [(cache.kda_state(i).clone(), cache.conv_state(i).clone()) for i in range(3)]
    cache.apply_copies([(1, 4, 3)], [(0, 2), (0, 3)])
    for i in range(2):
        kv = cache.mla_kv(i)
        assert torch.equal(kv[4, :3], before_kv[i][1, :3])  # copied rows
        assert torch.equal(kv[4, 3:], before_kv[i][4, 3:])  # the rest of the private block untouched
        assert torch.equal(kv[1], before_kv[i][1])  # source untouched
    for i in range(3):
        for pool, old in zip((cache.kda_state(i), cache.conv_state(i)), before_st[i]):
            assert torch.equal(pool[2], old[0]) and torch.equal(pool[3], old[0])
            assert torch.equal(pool[0], old[0]) and torch.equal(pool[1], old[1])


def _seq(seq_id: int, rid: str, prompt: list[int]) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return Sequence(seq_id=seq_id, request_id=rid, prompt_token_ids=prompt, max_tokens=4, sampling=params,
                    stop=StopChecker(params, (), None, 4))


def test_step_input_and_runner_plan_for_a_mixed_prefill_decode_step():
    cfg = EngineConfig(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=32,
        cache=CacheConfig(block_size=4, match_unit=2, alignment=4, kda_save_grid=1, num_blocks=1, num_state_slots=1),
    )
    mgr = CacheManager(cfg.cache, num_blocks=20, num_slots=8)
    sched = Scheduler(cfg, mgr)
    runner = ModelRunner(model=None, pools=_filled_cache(num_blocks=20, num_slots=8), max_blocks_per_seq=8)
    a = _seq(0, "a", [3, 1, 4, 1, 5])
    sched.add(a)
    first = sched.schedule()
    assert [r.request_id for r in first.new_requests] == ["a"] and first.chunks[0].admitted
    runner.apply_deltas(first)
    sched.update(StepOutput(first.step_id, (SampledToken("a", 9),)))  # a decodes next
    b = _seq(1, "b", [2, 7, 1, 8, 2, 8, 1])
    sched.add(b)
    step = sched.schedule()
    assert pickle.loads(pickle.dumps(step)) == step  # the contract is plain data
    assert [r.request_id for r in step.new_requests] == ["b"]  # "a" was sent once, in the first step
    assert step.num_decodes == 1 and [c.request_id for c in step.chunks] == ["a", "b"]  # decodes first
    ca, cb = step.chunks
    ta, tb = mgr.table(0), mgr.table(1)
    assert not ca.admitted and ca.block_ids == tuple(ta[len(first.chunks[0].block_ids):])  # only the new blocks
    assert cb.admitted and cb.block_ids == tuple(tb)
    runner.apply_deltas(step)
    plan = runner.plan(step)
    batch = runner.batch(plan)
    assert batch.input_ids.tolist() == [9, 2, 7, 1, 8, 2, 8, 1]
    assert batch.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 6]
    assert batch.cu_seqlens.tolist() == [0, 1, 8] and batch.seq_lens.tolist() == [6, 7]
    expected_slots = [ta[1] * 4 + 1] + [tb[p // 4] * 4 + p % 4 for p in range(7)]
    assert batch.slot_mapping.tolist() == expected_slots
    width = 8  # max_blocks_per_seq: small tables are sent at the fixed width a decode graph sees
    assert batch.block_table.tolist() == [ta + [0] * (width - len(ta)), tb + [0] * (width - len(tb))]
    assert batch.kda_slots.tolist() == [mgr.slot(0), mgr.slot(1)]
    assert batch.has_initial_state.tolist() == [True, False]
    assert batch.logits_indices.tolist() == [0, 7]
    assert not batch.is_decode
    # b's saves: the alignment point 4 and its last match-unit boundary 6, rows relative to the chunk start
    assert [p for p, _ in cb.saves] == [4, 6]
    assert batch.save_positions.tolist() == [[1, 4], [1, 6]]
    assert batch.save_slots.tolist() == [s for _, s in cb.saves]
    # a chunk that does not end at the sequence's last token asks for no logits
    deltas = sched.update(StepOutput(step.step_id, (SampledToken("a", 4), SampledToken("b", 6))))
    assert [d.new_token_ids for d in deltas] == [[4], [6]]
    sched.abort(a)
    nxt = sched.schedule()
    assert nxt.finished_request_ids == ("a",) and [c.request_id for c in nxt.chunks] == ["b"]
