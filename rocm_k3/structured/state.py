"""Per-request grammar state and the two batch operations of the sampler step.

The worker keeps one :class:`GrammarState` per constrained request and, every decode step:

1. ``rows = fill_bitmasks(states, bitmask)``: ``bitmask`` = ``allocate_bitmask(batch, compiler.vocab_size)``
   (int32 ``[N, ceil(V / 32)]`` on the CPU, xgrammar's layout: bit ``j % 32`` of word ``j // 32`` set = token
   ``j`` allowed); ``states[i]`` is the state of batch row i or None (unconstrained). Gated (still thinking)
   and finished states write nothing and are not in ``rows``. This can run while the forward pass runs.
2. ``apply_bitmask(logits, bitmask, rows)`` after the forward pass: masked logits become -inf, on the logits'
   device, only in ``rows`` (unconstrained rows are untouched, so they sample exactly as alone).
3. after sampling, ``states[i].accept(token)`` for every constrained row (also while gated: that is how the
   gate sees think end); ``is_terminated`` turns True once the grammar accepted the stop token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from rocm_k3.structured.gate import ReasoningGate


class GrammarRejectedError(RuntimeError):
    """A token the grammar does not allow was accepted (the sampler did not apply the mask)."""


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """int32 ``[batch_size, ceil(vocab_size / 32)]`` on the CPU, all tokens allowed."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


class GrammarState:
    """One request's grammar: gated off while the request thinks (``gate`` not None and not yet open), then an
    xgrammar matcher over everything after the gate."""

    def __init__(self, compiled: xgr.CompiledGrammar, gate: ReasoningGate | None) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._gate = gate
        self._n_constrained = 0

    @property
    def is_gated(self) -> bool:
        """True while the grammar does not apply yet (inside think)."""
        return self._gate is not None and not self._gate.is_open

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: the request must stop."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token is now allowed)."""
        return self._matcher.is_completed()

    @property
    def needs_bitmask(self) -> bool:
        return not self.is_gated and not self.is_terminated

    @property
    def num_constrained_tokens(self) -> int:
        """Tokens accepted by the grammar (after the gate opened)."""
        return self._n_constrained

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance by one generated token; raises GrammarRejectedError for a token the grammar forbids."""
        token_id = int(token_id)
        if self._gate is not None and not self._gate.is_open:
            self._gate.step(token_id)
            return
        if self._matcher.is_terminated():
            raise GrammarRejectedError(f"token {token_id} after the grammar terminated")
        if not self._matcher.accept_token(token_id):
            raise GrammarRejectedError(f"token {token_id} is not allowed by the grammar here")
        self._n_constrained += 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this step's allowed tokens into ``bitmask[row]``; returns False (row untouched) when the
        grammar does not apply now (gated or terminated), True when the row must be applied."""
        if not self.needs_bitmask:
            return False
        self._matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def fill_bitmask_ahead(self, bitmask: torch.Tensor, row: int, ahead: Sequence[int]) -> bool:
        """:meth:`fill_bitmask` as it would be after accepting ``ahead`` (the drafts before a speculative
        verification row): the matcher advances over them, fills, and rolls back (xgrammar's rollback is
        unlimited), so the state is unchanged. False (row untouched) while gated, and when a token of ``ahead`` is
        forbidden or follows the end: that row is unreachable (the draft was masked out of an earlier row)."""
        if self.is_gated:
            return False
        n = 0
        try:
            for tok in ahead:
                if self._matcher.is_terminated() or not self._matcher.accept_token(int(tok)):
                    return False
                n += 1
            return self.fill_bitmask(bitmask, row)
        finally:
            if n:
                self._matcher.rollback(n)


def fill_bitmasks(states: Sequence[GrammarState | None], bitmask: torch.Tensor,
                  batch_matcher: xgr.BatchGrammarMatcher | None = None) -> list[int]:
    """Fill ``bitmask`` rows for every state that applies now; returns those row indices. With a
    ``batch_matcher`` (xgrammar's threaded filler) the rows are filled in parallel."""
    if bitmask.dim() != 2 or bitmask.shape[0] < len(states):
        raise ValueError(f"bitmask: expected [>= {len(states)}, words], got {tuple(bitmask.shape)}")
    rows = [i for i, s in enumerate(states) if s is not None and s.needs_bitmask]
    if batch_matcher is not None and len(rows) > 1:
        batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, rows)
    else:
        for i in rows:
            states[i].fill_bitmask(bitmask, i)
    return rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], start: int = 0) -> None:
    """Set the disallowed logits of ``rows`` to -inf in place, on the logits' device (``logits`` [N, V]
    float32/bf16/fp16; ``bitmask`` int32 [N, >= ceil(V / 32)], any device, copied over when needed).
    ``start``: the logits hold tokens ``[start, start + V)`` (a rank's slice of a vocab-parallel LM head); the
    slice's bits are read from the whole-vocabulary bitmask."""
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"logits [N, V] and an int32 bitmask [N, W] expected, got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")
    if start + logits.shape[1] > bitmask.shape[1] * 32:
        raise ValueError(f"bitmask: {bitmask.shape[1]} words cover {bitmask.shape[1] * 32} tokens, logits have "
                         f"{start} + {logits.shape[1]}")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if start:  # a slice not at token 0: unpack its bits (word, bit) per column
        cols = torch.arange(start, start + logits.shape[1], device=logits.device)  # [V]
        idx = torch.tensor(list(rows), device=logits.device)  # [R]
        allowed = (bitmask[idx][:, cols // 32] >> (cols % 32).to(torch.int32)) & 1  # [R, V]
        logits[idx] = logits[idx].masked_fill(allowed == 0, float("-inf"))
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=list(rows))
