"""The worker's view of its requests: sampling parameters, generators and the output tokens confirmed so far.

:class:`RequestTable` is the worker's registry (register / drop / :meth:`RequestTable.begin_step`); a
:class:`StepBatch` is one step's sampling rows with their logits processors (penalties, grammar masks).

The engine confirms a sampled token by scheduling it: the next decode chunk carries the token sampled in the step
before, and a recomputed prefill (after a preemption or a rebuilt bookkeeping) carries all of them. The worker
learns a request's output from the chunks, never from its own samples, so a token the engine dropped (a failed
step, an exception in the bookkeeping) is never counted: penalties and grammars see exactly the tokens the
engine kept, in order, once each.

Speculation: a verification chunk's drafts are not confirmed by it. The engine keeps the accepted ones by starting
the request's next chunk after them, so the tokens between the last confirmed position and that start are the
drafts the worker was sent (:meth:`RequestState.observe`). Within a step, each verification row's penalties and
mask are those after the drafts before it (``ahead``, see ``spec_decode.acceptance``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.acceptance import draft_prefixes, expand_rows
from rocm_k3.worker.penalties import PenaltyState, penalty_processor
from rocm_k3.worker.sampler import LogitsProcessor, make_generator
from rocm_k3.worker.step_io import NewRequest, ScheduledChunk, StepInput
from rocm_k3.worker.structured_sampling import PendingMask, StructuredSampling


@dataclasses.dataclass
class RequestState:
    """One request on the worker.

    num_prompt_tokens: positions before it are the prompt; the tokens from there on are the output.
    num_seen:          sequence positions whose tokens have arrived in a chunk.
    penalties:         the token counts the penalties need (None when the request has no penalties).
    constraint:        the request's grammar / thinking-budget state (``structured_sampling``), or None.
    """

    request_id: str
    sampling: SamplingParams
    generator: torch.Generator
    num_prompt_tokens: int
    penalties: PenaltyState | None = None
    constraint: Any = None
    num_seen: int = 0
    prompt_token_ids: tuple[int, ...] = ()  # kept when the request asks for prompt log-probabilities
    drafts: tuple[int, tuple[int, ...]] = (0, ())  # the last verification's (first position, drafts)

    def observe(self, chunk: ScheduledChunk) -> list[int]:
        """The output tokens ``chunk`` confirms for the first time (empty for prompt tokens and repeats): the
        drafts of the previous verification that the engine kept (``chunk`` starts after them), then the chunk's
        own tokens before its drafts."""
        new: list[int] = []
        at, drafts = self.drafts
        self.drafts = (0, ())
        if drafts and at == self.num_seen < chunk.start:
            kept = drafts[: chunk.start - at]
            new += kept
            self.num_seen += len(kept)
        end = chunk.end - chunk.num_draft
        first = max(chunk.start, self.num_seen, self.num_prompt_tokens)
        new += chunk.token_ids[first - chunk.start : end - chunk.start] if end > first else ()
        self.num_seen = max(self.num_seen, end)
        if chunk.num_draft:
            self.drafts = (end, chunk.token_ids[end - chunk.start:])
        return new


class StepBatch:
    """One step's sampling rows (row i = ``chunks[i]``): params, generators, processors, per-row errors.

    The grammar masks are being filled on a helper thread from creation on; :meth:`close` waits for that fill,
    so call it in a ``finally`` (a fill must never run into the next step)."""

    def __init__(self, chunks: Sequence[ScheduledChunk], states: list[RequestState], mask: PendingMask | None,
                 ahead: list[tuple[int, ...]]) -> None:
        self.chunks = list(chunks)
        self.states = states
        self.params = [s.sampling for s in states]
        self.generators = [s.generator for s in states]
        self.ahead = ahead  # per row: the drafts before it (a verification row), else ()
        self._mask = mask

    def processors(self, tokens: tuple[int, int] | None = None) -> list[LogitsProcessor]:
        """Penalties first, then the grammar masks (the latter waits for the fill). ``tokens``: (start, width)
        of the vocabulary slice the logits hold (vocab-parallel sampling); None: the whole vocabulary."""
        found = (penalty_processor(self.params, [s.penalties for s in self.states], self.ahead, tokens),
                 None if self._mask is None else self._mask.processor(0 if tokens is None else tokens[0]))
        return [p for p in found if p is not None]

    def draft_limit(self, row: int) -> int | None:
        """The most drafts of the verification starting at ``row`` whose rows are processed exactly (None: all)."""
        constraint = self.states[row].constraint
        return None if constraint is None or constraint.speculates else 0

    def error(self, row: int) -> str:
        """Why row ``row``'s request must fail (its grammar could not be built or rejected a token), or ""."""
        constraint = self.states[row].constraint
        return constraint.error if constraint is not None else ""

    def errors(self) -> list[str]:
        """:meth:`error` of every row."""
        if self._mask is None and all(s.constraint is None for s in self.states):
            return [""] * len(self.states)
        return [self.error(i) for i in range(len(self.states))]

    def close(self) -> None:
        if self._mask is not None:
            self._mask.wait()


class RequestTable:
    """The requests a worker knows, until the engine reports them finished."""

    def __init__(self, structured: StructuredSampling, device: torch.device) -> None:
        self.structured = structured
        self.device = device
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def register(self, req: NewRequest) -> None:
        """Keep a new request's state; a request sent again (after a failed step) keeps what it has."""
        if req.request_id in self._states:
            return
        p = req.sampling
        state = RequestState(req.request_id, p, make_generator(p.seed, self.device), req.num_prompt_tokens)
        if p.has_penalties:
            state.penalties = PenaltyState(p, req.prompt_token_ids)
        if p.prompt_logprobs is not None:
            state.prompt_token_ids = tuple(req.prompt_token_ids)
        if p.needs_logits_mask:
            state.constraint = self.structured.new_constraint(p)
        self._states[req.request_id] = state

    def state(self, request_id: str) -> RequestState:
        return self._states[request_id]

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def begin_step(self, step: StepInput, sampling: Sequence[ScheduledChunk]) -> StepBatch:
        """Feed every request's newly confirmed output tokens to its penalties and grammar, then start filling
        the masks of the ``sampling`` chunks' rows (before the forward, so the fill overlaps it)."""
        t0 = time.perf_counter()
        for c in step.chunks:
            state = self._states[c.request_id]
            if state.penalties is None and state.constraint is None:
                state.num_seen = max(state.num_seen, c.end - c.num_draft)  # drafts are not confirmed
                continue
            tokens = state.observe(c)
            if tokens and state.penalties is not None:
                state.penalties.add(tokens)
            if tokens and state.constraint is not None:
                state.constraint.confirm(tokens)
        self.structured.timings.confirm_s += time.perf_counter() - t0
        rows = expand_rows(sampling)
        states = [self._states[c.request_id] for c in rows]
        ahead = draft_prefixes(sampling)
        return StepBatch(rows, states, self.structured.start([s.constraint for s in states], ahead), ahead)
