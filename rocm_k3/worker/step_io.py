"""The step contract between the control plane (engine) and the workers: plain, picklable dataclasses.

``Scheduler.schedule() -> StepInput`` carries everything a worker needs for one step and
``Scheduler.update(StepOutput)`` takes what the sampling worker returns. Only ints, floats, strings, bools,
lists, tuples and :class:`~rocm_k3.sampling_params.SamplingParams` (a frozen dataclass of the same) appear here,
so a step pickles and can be broadcast to the ranks of a multi-process executor unchanged.

A request travels once as :class:`NewRequest` (its sampling parameters and seed); every step then names it by
``request_id`` in a :class:`ScheduledChunk` with the tokens to run and the cache deltas (block ids appended to
its table, or the whole table and KDA slot when it was (re-)admitted). Workers keep per-request state (block
table row, KDA slot, sampling generator) until the request id appears in ``finished_request_ids``.
"""

from __future__ import annotations

import dataclasses

from rocm_k3.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request the workers have not seen: its sampling parameters (the seed seeds its generator).

    num_prompt_tokens: sequence positions from here on hold generated tokens (penalties and grammars follow them).
    prompt_token_ids:  the prompt, sent only when the sampler needs it (a repetition penalty), else empty.
    """

    request_id: str
    sampling: SamplingParams
    num_prompt_tokens: int
    prompt_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: ``token_ids`` at positions ``start .. start + len(token_ids) - 1``.

    admitted:      the request was (re-)admitted this step: ``block_ids`` is its whole block table and
                   ``kda_slot`` its running KDA slot (after a preemption both change; the worker resets the row).
    block_ids:     blocks appended to its table before this step (the whole table when admitted).
    kda_slot:      its running KDA slot (recurrent + conv state of every KDA layer).
    is_prefill:    the chunk belongs to a (re)computed prefill (else a one-token decode).
    sample:        the chunk ends at the request's last known token: the step samples its next token.
    saves:         (absolute position, destination KDA slot): save the KDA states after that position.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    admitted: bool
    block_ids: tuple[int, ...]
    kda_slot: int
    is_prefill: bool
    sample: bool
    saves: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class StepInput:
    """Everything the workers need for one step.

    step_id:               increases by one per step; every rank checks it (ranks must agree).
    new_requests:          requests seen for the first time (registered before the chunks run).
    chunks:                the scheduled requests, decodes first (``chunks[:num_decodes]`` are one-token decodes).
    num_decodes:           how many leading chunks are decodes.
    block_copies:          copy-on-write before the forward: (src block, dst block, rows) in every MLA layer.
    state_copies:          (src slot, dst slot): copy the recurrent + conv state of every KDA layer.
    finished_request_ids:  requests that ended since the last step (aborted, stopped, failed): drop their state.
    """

    step_id: int
    new_requests: tuple[NewRequest, ...] = ()
    chunks: tuple[ScheduledChunk, ...] = ()
    num_decodes: int = 0
    block_copies: tuple[tuple[int, int, int], ...] = ()
    state_copies: tuple[tuple[int, int], ...] = ()
    finished_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        """Every chunk is a one-token decode (the step may replay a captured decode graph)."""
        return bool(self.chunks) and self.num_decodes == len(self.chunks)


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """The token sampled for one request, with its log-probabilities when asked.

    logprobs: ``((token, logprob), ...)`` with the chosen token first, then the top alternatives; None if not asked.
    error:    non-empty when the request's logits were not finite (NaN/Inf): ``token_id`` is then meaningless.
    """

    request_id: str
    token_id: int
    logprobs: tuple[tuple[int, float], ...] | None = None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What the sampling worker returns for one step: one entry per chunk with ``sample`` set, in chunk order."""

    step_id: int
    sampled: tuple[SampledToken, ...] = ()
