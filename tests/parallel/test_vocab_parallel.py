"""dist tier: vocab-parallel sampling. At TP2 each rank's LM head computes only its vocabulary slice and the
sampler combines per-rank statistics (max with its first index, top-k candidates, log-sum-exp), so no rank holds
full-vocabulary logits; the tokens and log-probabilities equal one process's for greedy, seeded top-k / top-p /
min-p sampling, logprobs / top logprobs / prompt logprobs, penalties and structured output.

Two levels: the sampler itself on two gloo processes (random logits over a vocabulary wide enough that a top-p cut
needs more than the first candidates of each rank, a slice boundary inside a bitmask word), and the engine at TP2
against TP1 on the tiny K3."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rocm_k3.engine.llm import LLM
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.structured import StructuredOutputs
from rocm_k3.worker.sampler import make_generator, prompt_token_logprobs, sample
from rocm_k3.worker.vocab_shard import VocabShard
from tests.parallel.test_dist import ENGINE, PROMPTS, TP4_K3, free_port

pytestmark = pytest.mark.dist
VOCAB = 1000  # two slices of 500: 500 is not a multiple of 32 (a bitmask word spans the boundary)
ROWS = [  # (params, logits temperature): flat rows make top-p keep hundreds of tokens
    (SamplingParams(temperature=0.0, logprobs=3), 3.0),
    (SamplingParams(temperature=0.9, seed=1, top_k=40, logprobs=2), 3.0),
    (SamplingParams(temperature=1.0, seed=2, top_p=0.9), 0.05),
    (SamplingParams(temperature=1.0, seed=3, top_p=0.5, top_k=700, min_p=0.01, logprobs=1), 0.1),
    (SamplingParams(temperature=1.0, seed=4, min_p=0.2), 2.0),
    (SamplingParams(temperature=0.7, seed=5, top_p=0.3, repetition_penalty=1.5, frequency_penalty=0.4), 1.0),
]


def _processor(tokens: tuple[int, int]):
    """A penalty-like edit by global token id and a grammar-like mask (every third token banned), on the slice."""
    start, width = tokens

    def apply(logits: torch.Tensor) -> None:
        ids = torch.arange(start, start + width)
        logits[:, ids % 3 == 0] = float("-inf")
        logits[5, (ids % 7 == 1)] -= 2.0

    return apply


def _case(rank: int, size: int):
    gen = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randn(VOCAB, generator=gen) * t for _, t in ROWS])  # [N, V]
    params = [p for p, _ in ROWS]
    if size == 1:
        shard, part = None, logits
    else:
        shard = VocabShard.of_rank(VOCAB, rank, size, dist.group.WORLD)
        part = logits[:, shard.start : shard.start + shard.width]
    tokens = (0, VOCAB) if shard is None else (shard.start, shard.width)
    gens = [make_generator(p.seed) for p in params]
    out = [sample(part, params, gens, [_processor(tokens)], shard) for _ in range(3)]  # generators advance
    prompt = prompt_token_logprobs(part, [7, 600, 999, 0, 1, 2], [2, 0, 3, 1, 0, 5], shard)
    return [(o.token_ids.tolist(), o.logprobs, o.finite.tolist(), o.fallback.tolist()) for o in out], prompt


def _rank(rank: int, store: str, result) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        result.put((rank, _case(rank, 2)))
    finally:
        dist.destroy_process_group()


def _close(a, b) -> None:
    """Equal tokens and ranks; log-probabilities within 1e-5."""
    if isinstance(a, float):
        assert math.isclose(a, b, abs_tol=1e-5), (a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), (a, b)
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _close(x, y)
    else:
        assert a == b, (a, b)


def test_sampler_on_two_vocab_slices_matches_the_whole_vocabulary() -> None:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), result)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(result.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
    whole = _case(0, 1)
    for rank in (0, 1):
        _close(got[rank], whole)
    tokens = [t for o in whole[0] for t in o[0]]
    assert all(t % 3 for t in tokens), tokens  # the mask held on both slices
    assert any(t >= VOCAB // 2 for t in tokens) and any(t < VOCAB // 2 for t in tokens), tokens


SMALL = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "integer", "maximum": 9}},
         "required": ["mood", "n"], "additionalProperties": False}
ENGINE_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.8, seed=11, top_k=20, max_tokens=6, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=1.0, seed=12, top_p=0.8, min_p=0.05, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=13, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3,
                   max_tokens=8, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=14, max_tokens=40, structured_outputs=StructuredOutputs(json=SMALL),
                   skip_special_tokens=False),
]


def _engine_run(path, **layout):
    llm = LLM(path, master_port=free_port(), **ENGINE, **layout)
    try:
        prompts = PROMPTS + [[40, 41, 42], [7] * 9]
        outs = llm.generate(prompts, ENGINE_PARAMS)
        ranks = llm.engine.executor.rank_stats() if layout else []
        return [(o.token_ids, o.logprobs, o.prompt_logprobs, o.text, o.finish_reason) for o in outs], ranks
    finally:
        llm.shutdown()


def test_tp2_vocab_parallel_sampling_matches_one_process(tmp_path_factory) -> None:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("vocab_parallel"), seed=3, text_overrides=TP4_K3)
    single, _ = _engine_run(path)
    tp2, ranks = _engine_run(path, tensor_parallel_size=2)
    _close(tp2, single)
    assert single[4][4] == "stop" and '"mood"' in single[4][3], single[4]  # the grammar shaped the output
    for r in ranks:  # no rank gathered the logits; the sampler's collectives carried per-rank statistics
        c = r["collectives"]
        assert "lm_head_all_gather" not in c and c["sampler_all_gather"] > 0, c


@pytest.mark.parametrize("cuts", [(0, 500, 1000), (0, 333, 666, 1000)])
def test_grammar_masks_and_penalties_per_slice_equal_the_whole_row(cuts) -> None:
    """The bitmask (slices starting inside a 32-token word) and the penalties applied slice by slice give the
    whole row's logits."""
    from rocm_k3.structured import allocate_bitmask, apply_bitmask
    from rocm_k3.worker.penalties import PenaltyState, penalty_processor

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=gen)
    bitmask = allocate_bitmask(4, VOCAB)
    bitmask[:] = torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32)
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.2), SamplingParams(),
              SamplingParams(frequency_penalty=1.0), SamplingParams(repetition_penalty=0.6)]
    states = [PenaltyState(p, [3, 498, 499, 500, 501, 900]) if p.has_penalties else None for p in params]
    for s in states:
        if s is not None:
            s.add([1, 1, 499, 665, 666, 999])
    whole = logits.clone()
    penalty_processor(params, states)(whole)
    apply_bitmask(whole, bitmask, [0, 2, 3])
    parts = []
    for lo, hi in zip(cuts, cuts[1:]):
        part = logits[:, lo:hi].clone()
        penalty_processor(params, states, vocab_slice=(lo, hi - lo))(part)
        apply_bitmask(part, bitmask, [0, 2, 3], lo)
        parts.append(part)
    assert torch.equal(torch.cat(parts, dim=1), whole)
    assert torch.isinf(whole[0]).sum() > 100 and not torch.isinf(whole[1]).any()
