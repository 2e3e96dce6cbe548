"""Sampling parameters of one request (validated), as in ``rocm_k3.LLM.generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the structured package imports xgrammar, which only constrained requests need
    from rocm_k3.structured.spec import StructuredOutputs

SEED_MAX = 2**63 - 1  # seeds are non-negative 63-bit ints (a negative seed must not alias 2**64 + seed)
MAX_PENALTY = 2.0  # presence / frequency penalties live in [-2, 2] (the OpenAI range)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature:    0 = greedy (argmax); a finite number > 0 scales the logits before sampling.
    top_k:          keep the k most likely tokens (0 or -1 = all).
    top_p:          keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = all).
    min_p:          drop tokens less likely than ``min_p`` times the most likely one (0 = off), after temperature.
    seed:           seeds this request's own generator (same seed, same prompt -> same tokens), an int in
                    [0, 2**63 - 1]; None = random.
    max_tokens:     at most this many generated tokens.
    stop_token_ids: generation stops after emitting one of these (it is kept in the output ids); None = none.
    stop:           generation stops when the text contains one of these strings (the text is cut before it);
                    a single string or None are accepted.
    logprobs:       None, or the number of most likely alternatives to report per generated token (0 = only
                    the chosen token's log-probability); log-probabilities are of the model's distribution.
    prompt_logprobs: None, or the number of alternatives to report for each prompt token after the first (vLLM's:
                    the prompt token's own log-probability first, 0 = only that); the request then reads no
                    prefix from the cache (every prompt position is computed), though it still fills the cache.
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

    Numbers may be Python or numpy / other ``numbers`` scalars (stored as int / float); a value of the wrong type
    or range raises ValueError naming the field.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
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
        # store plain ints / floats / tuples, so the params stay hashable and the sampler sees Python numbers
        def set_(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        set_("stop", _stop_strings(self.stop))
        set_("stop_token_ids", _stop_ids(self.stop_token_ids))
        temperature = _number("temperature", self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        set_("temperature", temperature)
        top_k = _integer("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k: expected an int >= -1 (0 or -1 = disabled), got {self.top_k!r}")
        set_("top_k", top_k)
        top_p = _number("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        set_("top_p", top_p)
        if self.seed is not None:
            seed = _integer("seed", self.seed, or_none=True)
            if not 0 <= seed <= SEED_MAX:
                raise ValueError(f"seed: expected an int in [0, 2**63 - 1] or None, got {self.seed!r}")
            set_("seed", seed)
        max_tokens = _integer("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        set_("max_tokens", max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                value = _integer(name, getattr(self, name), or_none=True)
                if value < 0:
                    raise ValueError(f"{name}: expected None or an int >= 0, got {getattr(self, name)!r}")
                set_(name, value)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens: expected a bool, got {self.skip_special_tokens!r}")
        min_p = _number("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        set_("min_p", min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name}: expected a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got "
                                 f"{getattr(self, name)!r}")
            set_(name, value)
        repetition = _number("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(repetition) and repetition > 0):
            raise ValueError(f"repetition_penalty: expected a finite number > 0, got {self.repetition_penalty!r}")
        set_("repetition_penalty", repetition)
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


def _integer(name: str, value: Any, or_none: bool = False) -> int:
    """An int (numpy and other integral scalars too, never bool) or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: expected an int{' or None' if or_none else ''}, got {value!r} "
                         f"({type(value).__name__})")
    return int(value)


def _number(name: str, value: Any) -> float:
    """A float from any real scalar (never bool) or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """None -> (); a string -> (string,); an iterable of non-empty strings -> tuple."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Iterable):
        raise ValueError(f"stop: expected a string, a list of strings or None, got {stop!r} ({type(stop).__name__})")
    out = tuple(stop)
    if not all(isinstance(s, str) and s for s in out):
        raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
    return out


def _stop_ids(ids: Any) -> tuple[int, ...]:
    """None -> (); an iterable of non-negative integral ids -> tuple of ints."""
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
        raise ValueError(f"stop_token_ids: expected a list of ints or None, got {ids!r} ({type(ids).__name__})")
    out = tuple(ids)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in out):
        raise ValueError(f"stop_token_ids: expected non-negative ints, got {ids!r}")
    return tuple(int(t) for t in out)
