"""The worker's view of one request: its sampling parameters and generator, and the output tokens confirmed so far.

The engine confirms a sampled token by scheduling it: the next decode chunk carries the token sampled in the step
before, and a recomputed prefill (after a preemption or a rebuilt bookkeeping) carries all of them. The worker
learns a request's output from the chunks, never from its own samples, so a token the engine dropped (a failed
step, an exception in the bookkeeping) is never counted: penalties and grammars see exactly the tokens the
engine kept, in order, once each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.penalties import PenaltyState
from rocm_k3.worker.step_io import ScheduledChunk


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

    def observe(self, chunk: ScheduledChunk) -> list[int]:
        """The output tokens ``chunk`` confirms for the first time (empty for prompt tokens and repeats)."""
        first = max(chunk.start, self.num_seen, self.num_prompt_tokens)
        new = list(chunk.token_ids[first - chunk.start :]) if chunk.end > first else []
        self.num_seen = max(self.num_seen, chunk.end)
        return new
