"""Decode graphs with speculative decoding: the (batch, k) verification layout on the CPU (padding, save slots,
logits rows); the bucketed verification run eagerly through the graphs' buffers, the eager decode-shaped
verification and no speculation at all giving the same greedy tokens (n-gram and the embedded drafter, k in
{1, 3}); on the H200 (cuda tier) captured graphs give the same greedy tokens as eager steps, with speculation."""

from __future__ import annotations

import pytest
import torch

from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER, SpeculativeConfig
from rocm_k3.worker.cuda_graph import DecodeGraphs, graph_buckets
from rocm_k3.worker.kv_pools import KVPools, PoolShapes
from rocm_k3.worker.model_runner import ModelRunner, graph_width, split_verifications
from rocm_k3.worker.step_io import ScheduledChunk, StepInput
from tests.engine.test_spec_decode import _run as run_checked  # cache invariants every step, nothing leaked
from tests.eager_graphs import EagerGraphs
from tests.engine_fixtures import core_for
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

GEOM = PoolShapes(num_mla_layers=1, num_kda_layers=1, kda_heads=2, kda_head_dim=8, conv_width=4,
                  dtype=torch.float32)


def _verify(rid: str, tokens: tuple[int, ...], start: int, blocks: tuple[int, ...], slot: int,
            saves: tuple[tuple[int, int], ...] = ()) -> ScheduledChunk:
    return ScheduledChunk(rid, tokens, start, True, blocks, slot, False, True, saves=saves,
                          num_draft=len(tokens) - 1)


def test_a_verification_is_laid_out_in_groups_with_padding_and_fixed_save_slots() -> None:
    pools = KVPools(GEOM, block_size=4, num_blocks=10, num_slots=8)
    graphs = DecodeGraphs(model=None, pools=pools, width=5, buckets=[1, 2, 4], max_drafts=3)
    assert graphs.widths == [1, 2, 3, 4]
    runner = ModelRunner(None, pools, max_blocks_per_seq=5)
    # a: two drafts (saves after its first 1 and 2 tokens); b: a plain decode in the same step
    step = StepInput(step_id=1, chunks=(_verify("a", (11, 101, 102), 5, (3, 7), 2, ((6, 4), (7, 6))),
                                        _verify("b", (12,), 2, (4,), 5)))
    runner.apply_deltas(step)
    plan = runner.plan(step)
    assert not plan.is_decode and graph_width(step, plan) == 3
    rows = graphs.fill(plan, 2, 3)
    assert rows.tolist() == [0, 1, 2, 3]  # a's last token and both drafts, then b's token
    pad_slot, pad = pools.pad_slot, pools.pad_block * 4
    assert graphs.input_ids[:6].tolist() == [11, 101, 102, 12, 0, 0]
    assert graphs.positions[:6].tolist() == [5, 6, 7, 2, 0, 0]
    assert graphs.seq_lens[:6].tolist() == [6, 7, 8, 3, 1, 1]  # each row attends up to its own token
    assert graphs.slot_mapping[:6].tolist() == [7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 4 * 4 + 2, pad, pad]
    assert graphs.kda_slots[:6].tolist() == [2, 2, 2, 5, pad_slot, pad_slot]  # b's padding never touches slot 5
    assert graphs.save_slots[:4].tolist() == [4, 6, pad_slot, pad_slot]  # (group, column) -> slot
    assert graphs.block_table[1, :2].tolist() == [3, 7] and graphs.block_table[4, 0] == pools.pad_block
    batch = graphs.batch(2, 3)
    assert batch.decode_width == 3 and batch.num_seqs == 6
    assert batch.save_positions.tolist() == [[0, 1], [1, 1], [3, 1], [4, 1]]
    # a step with a prefill, or a draft beyond the widest graph, runs eagerly
    prefill = StepInput(step_id=2, chunks=(ScheduledChunk("c", (1, 2, 3), 0, True, (9,), 7, True, True),))
    runner.apply_deltas(prefill)
    assert graph_width(prefill, runner.plan(prefill)) is None
    with pytest.raises(ValueError, match="do not fit width"):
        graphs.fill(plan, 2, 2)
    with pytest.raises(ValueError, match="do not fit bucket"):
        graphs.fill(plan, 1, 3)
    assert graphs.key_for(2, 4) is None  # nothing captured: the runner falls back to the eager forward
    with pytest.raises(ValueError, match="max_drafts"):
        DecodeGraphs(model=None, pools=pools, width=5, buckets=[1], max_drafts=-1)


@pytest.fixture(scope="module")
def model():
    return load_model(ensure_embedded_model(), dtype=torch.float32, progress=False)


def _generate(model, spec: SpeculativeConfig | None, graphs: bool) -> tuple[dict, dict, DecodeGraphs | None]:
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, enable_prefix_caching=True,
                        num_blocks=48, num_state_slots=40)
    core = core_for(model, EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=96, cache=cache,
                                        speculative=spec))
    worker = core.executor.worker
    g = None
    if graphs:
        g = EagerGraphs(worker.stage, worker.runner.pools, worker.geometry.table_width, graph_buckets(4),
                        max_drafts=0 if spec is None else spec.num_speculative_tokens,
                        taps=worker.model if worker.proposer is not None else None)
        g.capture()
        worker.runner.graphs = g
    vocab = model.cfg.vocab_size
    prompts = [[5, 6, 7] * 6, [(i * 7) % vocab for i in range(20)], [9, 4] * 9]
    done = run_checked(core, prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    return done, core.stats(), g


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_shaped_verification_gives_the_greedy_tokens_of_no_speculation(model, method, k) -> None:
    spec = SpeculativeConfig(method=method, model=EMBEDDED_DRAFTER if method == "draft_model" else None,
                             num_speculative_tokens=k)
    base, _, _ = _generate(model, None, graphs=False)
    eager, _, _ = _generate(model, spec, graphs=False)
    graphed, stats, g = _generate(model, spec, graphs=True)
    assert graphed == eager == base
    assert g.verify_replays > 0 and stats["spec_num_accepted_tokens"] > 0, stats


def test_a_step_with_verifications_and_prefills_runs_them_as_two_forwards() -> None:
    decode = ScheduledChunk("d", (3,), 4, False, (), 1, False, True)
    verify = _verify("v", (5, 6), 7, (), 2)
    prefill = ScheduledChunk("p", (1, 2, 3), 0, True, (9,), 7, True, True, prompt_logprob_rows=2)
    step = StepInput(step_id=3, chunks=(decode, verify, prefill), num_decodes=1)
    head, tail = split_verifications(step)
    assert head.chunks == (decode, verify) and head.num_decodes == 1
    assert tail.chunks == (prefill,) and tail.num_decodes == 0
    for alone in (StepInput(step_id=4, chunks=(decode, prefill), num_decodes=1),  # no verification
                  StepInput(step_id=5, chunks=(decode, verify), num_decodes=1)):  # no prefill
        assert split_verifications(alone) == (alone, None)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_requests_arriving_while_others_verify_give_the_greedy_tokens_of_no_speculation(model, method) -> None:
    """A long prompt arrives while a request speculates: its prefill chunks share steps with verifications (two
    forwards per such step); both requests' tokens equal those without speculation."""
    vocab = model.cfg.vocab_size
    late = [(i * 11) % vocab for i in range(150)]  # three 64-token prefill chunks
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(spec):
        cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=8, num_blocks=48,
                            num_state_slots=40)
        core = core_for(model, EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256,
                                            cache=cache, speculative=spec))
        runner, forwards = core.executor.worker.runner, []
        inner = runner._forward
        runner._forward = lambda step, cache: forwards.append(step.step_id) or inner(step, cache)
        core.add_request("0", [5, 6, 7] * 6, params)
        done, steps = {}, 0
        while core.has_unfinished():
            steps += 1
            if steps == 4:
                core.add_request("1", late, params)
            for delta in core.step():
                if delta.finished:
                    done[delta.request_id] = delta.output.token_ids
        return done, len(forwards) - len(set(forwards)), core.stats()

    base, _, _ = run(None)
    spec = SpeculativeConfig(method=method, model=EMBEDDED_DRAFTER if method == "draft_model" else None,
                             num_speculative_tokens=3)
    out, split_steps, stats = run(spec)
    assert out == base
    assert split_steps >= 1 and stats["spec_num_accepted_tokens"] > 0, (split_steps, stats)


# ---------------------------------------------------------------------------------------------------------- cuda
def _cuda_greedy(spec: dict, eager: bool, prompts: list[list[int]]) -> tuple[list[list[int]], int, dict]:
    from rocm_k3.engine.llm import LLM

    llm = LLM(None, dtype="float32", backend="triton", device="cuda", enforce_eager=eager, max_num_seqs=8,
              max_model_len=512, kv_cache_bytes=1 << 30, state_cache_bytes=1 << 30, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    graphs = llm.engine.executor.worker.runner.graphs
    replays, stats = (0 if graphs is None else graphs.verify_replays), llm.engine.stats()
    llm.shutdown()
    return [o.token_ids for o in outs], replays, stats


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_captured_graphs_equals_eager_on_the_gpu(method: str, k: int) -> None:
    """Three requests (bucket 4 with a padded group), fp32 without TF32: captured (batch, 1 + k) graphs verify
    the drafts; the tokens equal the eager steps' (the same decode shape, unpadded)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = EMBEDDED_DRAFTER
    prompts = [[5, 6, 7] * 6, [(i * 7) % 200 for i in range(20)], [9, 4] * 9]
    eager, _, _ = _cuda_greedy(spec, True, prompts)
    graphed, replays, stats = _cuda_greedy(spec, False, prompts)
    assert replays > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert graphed == eager


def test_a_bad_decode_width_is_named() -> None:
    from rocm_k3.model.forward_batch import ForwardBatch

    def batch(w, n=4, saves=None, decode=True) -> ForwardBatch:
        i32, i64 = torch.int32, torch.int64
        return ForwardBatch(
            input_ids=torch.zeros(n, dtype=i64), positions=torch.zeros(n, dtype=i64),
            cu_seqlens=torch.arange(n + 1, dtype=i32), seq_lens=torch.ones(n, dtype=i32),
            block_table=torch.zeros(n, 1, dtype=i32), slot_mapping=torch.zeros(n, dtype=i64),
            kda_slots=torch.zeros(n, dtype=i32), has_initial_state=torch.ones(n, dtype=torch.bool),
            logits_indices=torch.arange(n, dtype=i64), is_decode=decode, decode_width=w,
            save_positions=None if saves is None else torch.ones(saves, 2, dtype=i32),
            save_slots=None if saves is None else torch.zeros(saves, dtype=i32))

    assert batch(2, saves=2).decode_width == 2
    for w, kw, message in ((0, {}, "positive int"), (3, {}, "whole groups"), (2, {"decode": False}, "whole groups"),
                           (2, {"saves": 3}, "expects 2 save rows")):
        with pytest.raises(ValueError, match=message):
            batch(w, **kw)
