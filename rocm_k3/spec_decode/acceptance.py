"""Acceptance of drafted tokens (worker side, after the one target forward of a verification step).

Every logits row of a verification chunk (its last confirmed token, then each draft) is sampled with the
ordinary sampler: the request's temperature, min-p, top-k, top-p and its own generator, row after row. Draft j is
accepted when the token sampled at row j equals it; the first row that disagrees gives the target's token and
ends the chunk; when every draft is accepted the last row gives the bonus token.

For a deterministic proposer (n-gram: q = one-hot at the draft x) this *is* rejection sampling: x is accepted
with probability p(x) = min(1, p(x) / q(x)), and a rejected row's token is distributed as p restricted to the
tokens other than x, renormalised, which is norm(max(0, p - q)). So the output follows the target distribution
exactly; at temperature 0 it is the greedy rule (longest prefix matching the argmax, then the argmax). Seeded
requests stay reproducible (their generator draws one race per row in order).

Penalties and grammars: row j is processed as if drafts 0 .. j - 1 were confirmed (:func:`draft_prefixes`: the
penalty counts advanced by them, the grammar matcher advanced over them and rolled back after the fill), so row j
samples from the target's penalised / masked distribution given the accepted prefix; a draft the grammar forbids
is masked out of its row and can never be accepted. A row whose state is not simulated ahead (a constrained request
still inside think: its reasoning gate and budget count) caps the chunk's usable drafts (``limit_of``): the rows
past the cap are ignored, as if fewer drafts had been sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rocm_k3.worker.step_io import SampledToken, ScheduledChunk


def expand_rows(chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
    """The sampling row list: each chunk repeated once per logits row (1 + num_draft)."""
    if not any(c.num_draft for c in chunks):
        return list(chunks)
    return [c for c in chunks for _ in range(1 + c.num_draft)]


def draft_prefixes(chunks: Sequence[ScheduledChunk]) -> list[tuple[int, ...]]:
    """Per sampling row (:func:`expand_rows` order): the drafts its logits come after (row j: drafts[:j])."""
    if not any(c.num_draft for c in chunks):
        return [()] * len(chunks)
    out = []
    for c in chunks:
        drafts = tuple(c.token_ids[len(c.token_ids) - c.num_draft:]) if c.num_draft else ()
        out += [drafts[:j] for j in range(1 + c.num_draft)]
    return out


def accept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> tuple[list[int], int]:
    """(accepted drafts, the target's token after them) from ``sampled`` (len(drafts) + 1 row tokens)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"accept_drafts: expected {len(drafts) + 1} sampled tokens, got {len(sampled)}")
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return list(drafts[:a]), int(sampled[a])


def verify_rows(chunks: Sequence[ScheduledChunk], tokens: Sequence[int], finite: Sequence[bool],
                logprobs: Sequence[dict[int, float] | None], error_of: Callable[[int], str],
                non_finite: str, limit_of: Callable[[int], int | None] = lambda row: None
                ) -> tuple[SampledToken, ...]:
    """One SampledToken per chunk from the per-row ``tokens`` / ``finite`` / ``logprobs`` (rows in
    :func:`expand_rows` order); ``error_of(row)`` names a row's request failure, ``limit_of(row)`` the most drafts
    of the chunk starting at that row that may be used (None: all). Each accepted draft carries its row's logprobs
    (the chosen token there is the draft), the final token those of the row that produced it."""
    out = []
    row = 0
    for c in chunks:
        n = 1 + c.num_draft
        drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ()
        limit = limit_of(row)
        usable = len(drafts) if limit is None else min(limit, len(drafts))
        accepted, token = accept_drafts(drafts[:usable], tokens[row:row + usable + 1])
        used = len(accepted) + 1  # rows whose tokens were used
        ok = all(finite[row:row + used])
        error = error_of(row) or ("" if ok else non_finite)
        lps = [None if lp is None else tuple(lp.items()) for lp in logprobs[row:row + used]]
        if error:
            out.append(SampledToken(c.request_id, token, lps[-1], error))
        else:
            kept = tuple(lp for lp in lps[:-1] if lp is not None)
            out.append(SampledToken(c.request_id, token, lps[-1], error, tuple(accepted), kept))
        row += n
    return tuple(out)
