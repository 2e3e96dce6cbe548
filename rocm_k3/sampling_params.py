"""Sampling parameters of one request (validated), as in ``rocm_k3.LLM.generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the structured package imports xgrammar, which only constrained requests need
    from rocm_k3.structured.spec import StructuredOutputs

MAX_PENALTY = 2.0  # presence / frequency penalties live in [-2, 2] (the OpenAI range)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature:    0 = greedy (argmax); > 0 scales the logits before sampling.
    top_k:          keep the k most likely tokens (0 or -1 = all).
    top_p:          keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = all).
    min_p:          drop tokens less likely than ``min_p`` times the most likely one (0 = off), after temperature.
    seed:           seeds this request's own generator (same seed, same prompt -> same tokens); None = random.
    max_tokens:     at most this many generated tokens.
    stop_token_ids: generation stops after emitting one of these (it is kept in the output ids).
    stop:           generation stops when the text contains one of these strings (the text is cut before it).
    logprobs:       None, or the number of most likely alternatives to report per generated token (0 = only
                    the chosen token's log-probability); log-probabilities are of the model's distribution.
    ignore_eos:     keep generating past the model's end-of-sequence token.
    skip_special_tokens: leave special tokens (e.g. ``<|end_of_msg|>``) out of the output text (the ids stay).
    presence_penalty:   subtracted from the logit of every token generated so far (in [-2, 2]; 0 = off).
    frequency_penalty:  subtracted once per earlier occurrence in the generated tokens (in [-2, 2]; 0 = off).
    repetition_penalty: tokens of the prompt or the output so far get their logit divided by it when positive,
                        multiplied when negative (> 0; 1 = off). Penalties apply before temperature, greedy too.
    structured_outputs: a :class:`~rocm_k3.structured.spec.StructuredOutputs` constraint (JSON schema, regex,
                        choice, EBNF grammar, structural tag, forced tool calls) enforced by a grammar on the
                        worker; the grammar ends with an end-of-sequence token, so ``ignore_eos`` cannot be set.
    prompt_in_think:    the prompt ends inside the model's think channel (a chat rendered with thinking on): the
                        grammar then starts once the reasoning has ended.
    thinking_token_budget: with ``prompt_in_think``, at most this many tokens of reasoning; then the think-close
                        marker is forced (None = unlimited).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputs | None = dataclasses.field(default=None, hash=False)
    prompt_in_think: bool = False
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        # accept lists (and a single stop string) for convenience; store tuples so the params stay hashable
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k: expected an int >= -1 (0 or -1 = disabled), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= 2**63 - 1):
            raise ValueError(f"seed: expected an int in [0, 2**63 - 1] or None, got {self.seed!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"stop_token_ids: expected non-negative ints, got {self.stop_token_ids!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: expected non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs: expected None or an int >= 0, got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens: expected a bool, got {self.skip_special_tokens!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name}: expected a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty: expected a finite number > 0, got {self.repetition_penalty!r}")
        self._check_structured()

    def _check_structured(self) -> None:
        if not isinstance(self.prompt_in_think, bool):
            raise ValueError(f"prompt_in_think: expected a bool, got {self.prompt_in_think!r}")
        budget = self.thinking_token_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ValueError(f"thinking_token_budget: expected an int >= 0 or None, got {budget!r}")
            if not self.prompt_in_think:
                raise ValueError("thinking_token_budget: only applies when the prompt ends inside the think channel "
                                 "(prompt_in_think=True)")
        if self.structured_outputs is None:
            return
        from rocm_k3.structured.spec import StructuredOutputs

        if not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs: expected a StructuredOutputs, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with structured_outputs (the grammar ends with an "
                             "end-of-sequence token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_logits_mask(self) -> bool:
        """The worker masks this request's logits (a grammar, or a thinking budget to enforce)."""
        return self.structured_outputs is not None or self.thinking_token_budget is not None


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))
