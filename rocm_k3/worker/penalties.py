"""Repetition, presence and frequency penalties on the worker, from each request's confirmed tokens.

For a request with penalties (the definitions OpenAI and vLLM use), before temperature:

- ``repetition_penalty`` r: every token of the prompt or the output so far has its logit ``l`` replaced by
  ``l / r`` when ``l > 0`` and ``l * r`` otherwise;
- ``frequency_penalty`` f and ``presence_penalty`` p: ``l -= f * count + p * (count > 0)`` where ``count`` is how
  often the token occurs in the output so far.

:class:`PenaltyState` keeps the counts (updated from the tokens the engine confirmed, see ``request_state``);
:func:`penalty_processor` builds one step's processor over the sampling rows. Each row uses only its own counts,
so a request's tokens do not depend on its batch mates.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

import torch

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.sampler import LogitsProcessor


class PenaltyState:
    """One request's token counts. prompt_token_ids: only needed (and kept) with a repetition penalty."""

    def __init__(self, params: SamplingParams, prompt_token_ids: Iterable[int]) -> None:
        self.repetition = params.repetition_penalty != 1
        self.counts: collections.Counter[int] = collections.Counter()  # output token -> occurrences
        self.seen: set[int] = set(prompt_token_ids) if self.repetition else set()
        self._seen_ids: torch.Tensor | None = None  # the seen set as a tensor, rebuilt when it grows

    def add(self, tokens: Sequence[int]) -> None:
        self.counts.update(tokens)
        if self.repetition:
            before = len(self.seen)
            self.seen.update(tokens)
            if len(self.seen) != before:
                self._seen_ids = None

    def seen_ids(self) -> torch.Tensor:
        """int64 [K] the distinct tokens of the prompt and output so far."""
        if self._seen_ids is None:
            self._seen_ids = torch.tensor(sorted(self.seen), dtype=torch.int64)
        return self._seen_ids

    def ahead(self, tokens: Sequence[int]) -> tuple[torch.Tensor, Mapping[int, int]]:
        """(seen ids [K], output counts) as they would be after ``tokens`` more output tokens (the drafts before a
        verification row); the state itself is unchanged. Without a repetition penalty the seen ids are empty."""
        if not self.repetition:
            seen = torch.zeros(0, dtype=torch.int64)
        elif tokens:
            seen = torch.tensor(sorted(self.seen.union(tokens)), dtype=torch.int64)
        else:
            seen = self.seen_ids()
        return seen, (self.counts + collections.Counter(tokens) if tokens else self.counts)


def penalty_processor(params: Sequence[SamplingParams], states: Sequence[PenaltyState | None],
                      ahead: Sequence[Sequence[int]] | None = None,
                      vocab_slice: tuple[int, int] | None = None) -> LogitsProcessor | None:
    """The processor for one step's sampling rows (row i: ``params[i]``, ``states[i]``), or None when no row has a
    penalty. ``ahead[i]``: output tokens row i comes after beyond the state's (a verification row: the drafts
    before it), counted as if confirmed. Index tensors are built on the host here; the processor moves them to
    the logits' device. ``vocab_slice``: (start, width) of the vocabulary slice the logits hold (a vocab-parallel
    LM head): the penalties of the other ranks' tokens are dropped here and the ids made local; None: the whole
    vocabulary."""
    rep_rows, rep_ids, rep_vals = [], [], []
    cnt_rows, cnt_ids, cnt_vals, cnt_freq, cnt_pres = [], [], [], [], []
    for i, (p, state) in enumerate(zip(params, states)):
        if state is None or not p.has_penalties:
            continue
        ids, counts = state.ahead(ahead[i] if ahead is not None else ())
        if state.repetition and len(ids):
            rep_rows.append(torch.full_like(ids, i))
            rep_ids.append(ids)
            rep_vals.append(float(p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and counts:
            tokens = list(counts)
            cnt_rows.extend([i] * len(tokens))
            cnt_ids.extend(tokens)
            cnt_vals.extend(counts[t] for t in tokens)
            cnt_freq.extend([float(p.frequency_penalty)] * len(tokens))
            cnt_pres.extend([float(p.presence_penalty)] * len(tokens))
    if not rep_rows and not cnt_rows:
        return None
    if vocab_slice is not None:
        rep_rows, rep_ids, rep_vals = _in_slice(rep_rows, rep_ids, rep_vals, vocab_slice)
        cnt_rows, cnt_ids, cnt_vals, cnt_freq, cnt_pres = _in_slice_flat(
            cnt_rows, cnt_ids, (cnt_vals, cnt_freq, cnt_pres), vocab_slice)
        # a slice without penalised tokens still gets a (no-op) processor: every rank runs the same sampler steps
    rep = None
    if rep_rows:
        sizes = [len(r) for r in rep_rows]
        rep = (torch.cat(rep_rows), torch.cat(rep_ids),
               torch.repeat_interleave(torch.tensor(rep_vals), torch.tensor(sizes)))  # [K] each
    cnt = None
    if cnt_rows:
        counts = torch.tensor(cnt_vals, dtype=torch.float32)
        cnt = (torch.tensor(cnt_rows), torch.tensor(cnt_ids),
               torch.tensor(cnt_freq) * counts + torch.tensor(cnt_pres))  # [M] each: the amount to subtract

    def apply(logits: torch.Tensor) -> None:
        dev = logits.device
        if rep is not None:
            rows, ids, r = (t.to(dev, non_blocking=True) for t in rep)
            vals = logits[rows, ids]
            logits[rows, ids] = torch.where(vals > 0, vals / r, vals * r)
        if cnt is not None:
            rows, ids, amount = (t.to(dev, non_blocking=True) for t in cnt)
            logits[rows, ids] -= amount

    return apply


def _in_slice(rows: list, ids: list, vals: list, tokens: tuple[int, int]) -> tuple[list, list, list]:
    """Per-request id tensors of the repetition penalty, kept to the slice ``tokens`` = (start, width), local ids."""
    start, width = tokens
    out_rows, out_ids, out_vals = [], [], []
    for r, i, v in zip(rows, ids, vals):
        mine = (i >= start) & (i < start + width)
        if bool(mine.any()):
            out_rows.append(r[mine])
            out_ids.append(i[mine] - start)
            out_vals.append(v)
    return out_rows, out_ids, out_vals


def _in_slice_flat(rows: list[int], ids: list[int], columns: tuple[list, ...], tokens: tuple[int, int]) -> tuple:
    """The count-penalty entries (flat lists) whose token is in the slice ``tokens``, with local ids."""
    start, width = tokens
    keep = [j for j, t in enumerate(ids) if start <= t < start + width]
    return ([rows[j] for j in keep], [ids[j] - start for j in keep], *([c[j] for j in keep] for c in columns))
