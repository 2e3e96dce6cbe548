"""Batched next-token sampling from fp32 logits (worker side), one seeded generator per request.

For each row: the logits processors (repetition / presence / frequency penalties, grammar masks) edit a copy of
the logits first; then temperature 0 = argmax; otherwise the logits are divided by the temperature, tokens less
likely than min-p times the most likely one are dropped, the rest restricted to the top-k tokens and then to the
smallest most-likely set whose probability reaches top-p, and a token is drawn from the softmax with the
request's own ``torch.Generator`` (the exponential-race form of a categorical draw, ``argmax(p / E)`` with
``E ~ Exp(1)``), so a request's tokens do not depend on which other requests share its batch (each processor
works row by row too). Log-probabilities are those of the unmodified distribution ``log_softmax(logits)``.
A row with a NaN or infinite logit is flagged (``finite[i]`` False); its token is meaningless and the engine
finishes that request with an error, leaving its batch mates alone.

A row whose model logits are finite but whose processed logits are not a distribution (NaN from ``inf - inf`` or
``x / 1e-30`` after an extreme penalty, every token masked, all-zero probabilities after a tiny top-p / min-p)
never draws from it: it takes the top non-NaN processed logit (the top model logit when none is left) and is
flagged ``fallback[i]`` (counted in ``/metrics`` as ``rocm_k3_sampler_fallbacks_total``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.vocab_shard import VocabShard

MAX_SEED = (1 << 63) - 1
TOP_P_CANDIDATES = 64  # each rank's most likely tokens a top-p cut is first looked for among
PROMPT_LOGPROB_ROWS = 512  # prompt positions per log-softmax slice (bounds the transient [rows, vocab] copy)

# edits a [N, V] fp32 logits tensor in place (rows it does not concern stay untouched)
LogitsProcessor = Callable[[torch.Tensor], None]


class SampleOutput(NamedTuple):
    """token_ids int64 [N]; logprobs[i] = {token: logprob} (chosen token first, then the top alternatives) or None;
    finite bool [N]: the row's logits were all finite; fallback bool [N]: the row's processed probabilities were
    unusable (NaN, nothing left, all zero) and its token is the top logit instead of a draw."""

    token_ids: torch.Tensor
    logprobs: list[dict[int, float] | None]
    finite: torch.Tensor
    fallback: torch.Tensor


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator: seeded with ``seed``, or from fresh OS entropy when None."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed: expected an int in [0, 2**63 - 1] or None, got {seed!r}")
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
           logits_processors: Sequence[LogitsProcessor] = (), shard: VocabShard | None = None) -> SampleOutput:
    """Pick one token per row of ``logits`` fp32 [N, V] under ``params[i]`` with ``generators[i]``; the processors
    run in order on a copy of ``logits`` (the finite flags and log-probabilities stay those of ``logits``).

    ``shard``: the vocabulary slice ``logits`` [N, shard.width] holds (a vocab-parallel LM head); every TP rank
    calls this with its slice (and as many processors) and gets the same tokens, flags and log-probabilities (None:
    the whole vocabulary)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits: expected a [N, V] tensor, got {getattr(logits, 'shape', type(logits))}")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits: expected dtype torch.float32, got {logits.dtype}")
    n, width = logits.shape
    shard = VocabShard.whole(width) if shard is None else shard
    if width != shard.width:
        raise ValueError(f"logits: {width} columns for a vocabulary slice of {shard.width} tokens")
    if len(params) != n or len(generators) != n:
        raise ValueError(f"params/generators: expected {n} each (one per row), got {len(params)} and {len(generators)}")
    dev = logits.device
    processed = logits
    if logits_processors:
        processed = logits.clone()
        for processor in logits_processors:
            processor(processed)
    # NaN (e.g. inf - inf from an extreme penalty) never wins a pick: the top logit among the rest does
    nan = torch.isnan(processed)  # [N, V]
    # [N, 2]: a non-finite model logit, a NaN processed logit (one collective over the slices)
    flags = shard.flags_any(torch.stack([~torch.isfinite(logits).all(dim=-1), nan.any(dim=-1)], dim=-1))
    finite = ~flags[:, 0]  # [N]
    top, chosen = shard.argmax(processed.masked_fill(nan, float("-inf")))  # [N], [N]: one pass
    # nothing left to pick from (every logit NaN or masked): the model's own top logit, never token 0 by default
    empty = top == float("-inf")  # [N]
    if processed is not logits:  # (unprocessed: the model's top logit is the pick already)
        chosen = torch.where(empty, shard.argmax(_nan_to_neg_inf(logits))[1], chosen)  # [N]
    fallback = (flags[:, 1] | empty) & finite  # [N]
    if not all(p.temperature == 0 for p in params):
        temps = torch.tensor([float(p.temperature) for p in params], device=dev)  # [N]
        scaled = processed / temps.clamp_min(1e-6)[:, None]  # [N, V]
        scaled = _apply_min_p(scaled, [float(p.min_p) for p in params], shard)
        scaled = _apply_top_k(scaled, [p.top_k for p in params], shard)
        scaled = _apply_top_p(scaled, [float(p.top_p) for p in params], shard)
        probs = shard.softmax(scaled)  # [N, V]
        # a row whose processed probabilities are not a distribution (NaN from +-inf logits after an extreme
        # repetition penalty, or all zero) keeps its top logit instead of a draw from garbage
        seen = shard.flags_any(torch.stack([~torch.isfinite(probs).all(dim=-1), probs.sum(dim=-1) > 0], dim=-1))
        usable_t = ~seen[:, 0] & seen[:, 1]  # [N] all finite, some mass
        sampled_t = torch.tensor([p.temperature != 0 for p in params], device=dev)  # [N]
        fallback |= sampled_t & ~usable_t & finite
        usable = usable_t.tolist()  # one host read
        draw = [p.temperature != 0 and usable[i] for i, p in enumerate(params)]
        if any(draw):
            race = torch.ones_like(probs)  # [N, V] ~ Exp(1) on the drawn rows
            for i, (p, gen) in enumerate(zip(params, generators)):
                if draw[i]:
                    race[i] = shard.race(gen, p.seed is not None, dev)
            drawn = shard.argmax(probs / race)[1]  # [N] the exponential race's winners
            chosen = torch.where(torch.tensor(draw, device=dev), drawn, chosen)
    return SampleOutput(chosen, _logprobs(logits, chosen, params, shard), finite, fallback)


def _nan_to_neg_inf(x: torch.Tensor) -> torch.Tensor:
    """NaN entries as -inf, infinities kept (``torch.nan_to_num`` would clamp them to finite values)."""
    return x.masked_fill(torch.isnan(x), float("-inf"))


def _apply_min_p(scaled: torch.Tensor, min_p: list[float], shard: VocabShard) -> torch.Tensor:
    if all(m <= 0 for m in min_p):
        return scaled
    m_t = torch.tensor(min_p, device=scaled.device)[:, None]  # [N, 1]
    probs = shard.softmax(scaled)  # [N, V]
    keep = probs >= m_t * shard.max(probs.max(dim=-1).values)[:, None]  # the most likely token always stays
    return scaled.masked_fill(~keep, float("-inf"))


def _apply_top_k(scaled: torch.Tensor, top_k: list[int], shard: VocabShard) -> torch.Tensor:
    vocab = shard.vocab
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks):
        return scaled
    k_t = torch.tensor(ks, device=scaled.device)  # [N]
    top = shard.topk(scaled, max(ks))[0]  # [N, max k] largest first
    kth = top.gather(1, (k_t - 1)[:, None])  # [N, 1] the k-th largest value
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, top_p: list[float], shard: VocabShard) -> torch.Tensor:
    """Keep the smallest most-likely set whose probability reaches top-p: a token stays while the mass of the
    tokens before it (largest first) is below p. The candidates are each rank's ``m`` most likely tokens, merged;
    a row is settled once its cut falls above every rank's ``m``-th probability (no token left out can come
    before the cut), else ``m`` grows (one host read per round, for all rows at once)."""
    if all(p >= 1.0 for p in top_p):
        return scaled
    dev = scaled.device
    p_t = torch.tensor(top_p, device=dev)[:, None]  # [N, 1]
    probs = shard.softmax(scaled)  # [N, V]
    keep = torch.zeros_like(probs, dtype=torch.bool)  # [N, V]
    todo = p_t[:, 0] < 1.0  # [N]
    # the whole vocabulary on this rank: one pass over every token (no round, no host read); slices: rounds
    m = shard.per_rank if shard.is_whole else min(TOP_P_CANDIDATES, shard.per_rank)
    while True:
        vals, ids = shard.candidates(probs, m)  # [N, C] largest first, global ids
        kept = (vals.cumsum(dim=-1) - vals) < p_t  # [N, C] a prefix: the mass before each candidate
        n_kept = kept.sum(dim=-1)  # [N]
        last = vals.gather(1, (n_kept - 1).clamp_min(0)[:, None])[:, 0]  # [N] the last kept probability
        # the safe bound: a token not among the candidates is at most its rank's m-th probability
        bound = shard.max(probs.topk(min(m, shard.width), dim=-1).values[:, -1]) if m < shard.per_rank else None
        settled = todo if bound is None else todo & (n_kept < vals.shape[1]) & (last > bound)
        keep |= shard.scatter_local(ids, kept & settled[:, None])
        todo = todo & ~settled
        if bound is None or not bool(todo.any()):
            break
        m = min(m * 8, shard.per_rank)
    return scaled.masked_fill(~keep & (p_t < 1.0), float("-inf"))


def _logprobs(logits: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams],
              shard: VocabShard) -> list[dict[int, float] | None]:
    """The chosen token's log-probability and the top ``logprobs`` alternatives of the rows that ask, computed
    for those rows at once and read to the host in one transfer (no per-row synchronisation)."""
    wanted = [p.logprobs for p in params]
    rows = [i for i, w in enumerate(wanted) if w is not None]
    if not rows:
        return [None] * len(params)
    idx = torch.tensor(rows, device=logits.device)  # [R]
    logp = shard.log_softmax(logits[idx])  # [R, V]
    picked = chosen[idx]  # [R]
    k = min(max(wanted[i] for i in rows), shard.vocab)
    top = shard.topk(logp, k) if k > 0 else None  # [R, k]
    parts = [picked, shard.pick(logp, picked).double()]
    if top is not None:
        parts += [top[1].reshape(-1).to(picked.dtype), top[0].reshape(-1).double()]
    host = torch.cat([p.double() for p in parts]).tolist()  # the one device -> host read
    r = len(rows)
    tokens, values = host[:r], host[r : 2 * r]
    top_ids, top_vals = host[2 * r : 2 * r + r * k], host[2 * r + r * k :]
    out: list[dict[int, float] | None] = [None] * len(params)
    for j, i in enumerate(rows):
        entry = {int(tokens[j]): values[j]}
        for t, v in zip(top_ids[j * k : j * k + wanted[i]], top_vals[j * k : j * k + wanted[i]]):
            entry.setdefault(int(t), v)
        out[i] = entry
    return out


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], top: Sequence[int],
                          shard: VocabShard | None = None) -> tuple[list[tuple[tuple[int, float], ...]], list[int]]:
    """Per row of ``logits`` fp32 [M, V]: ``((targets[i], logprob), then the top[i] most likely (token, logprob))``
    and the target's rank (1 = most likely), of the model's distribution ``log_softmax(logits)``; read to the
    host in one transfer. ``shard``: the vocabulary slice ``logits`` holds (see :func:`sample`)."""
    m = len(targets)
    if logits.shape[0] != m or len(top) != m:
        raise ValueError(f"prompt logprobs: {logits.shape[0]} logits rows for {m} targets and {len(top)} top counts")
    tgt = torch.tensor(list(targets), dtype=torch.int64, device=logits.device)  # [M]
    shard = VocabShard.whole(logits.shape[1]) if shard is None else shard
    k = min(max(top, default=0), shard.vocab)
    picked, ranks, best_ids, best_vals = [], [], [], []
    for lo in range(0, m, PROMPT_LOGPROB_ROWS):  # a long prompt's [M, V] log-softmax in slices, not at once
        logp = shard.log_softmax(logits[lo : lo + PROMPT_LOGPROB_ROWS])  # [m', V]
        chosen = shard.pick(logp, tgt[lo : lo + PROMPT_LOGPROB_ROWS])  # [m']
        picked.append(chosen)
        ranks.append(shard.sum((logp > chosen[:, None]).sum(dim=-1)) + 1)  # [m']
        if k > 0:
            best_v, best_i = shard.topk(logp, k)  # [m', k]
            best_ids.append(best_i.reshape(-1))
            best_vals.append(best_v.reshape(-1))
    parts = [torch.cat(picked).double(), torch.cat(ranks).double()]
    if k > 0:
        parts += [torch.cat(best_ids).double(), torch.cat(best_vals).double()]
    host = torch.cat(parts).tolist()  # the one device -> host read
    values, rank_list = host[:m], [int(r) for r in host[m : 2 * m]]
    ids, vals = host[2 * m : 2 * m + m * k], host[2 * m + m * k :]
    entries = []
    for i in range(m):
        entry = {int(targets[i]): values[i]}
        for t, v in zip(ids[i * k : i * k + top[i]], vals[i * k : i * k + top[i]]):
            entry.setdefault(int(t), v)
        entries.append(tuple(entry.items()))
    return entries, rank_list
