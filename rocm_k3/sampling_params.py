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
MAX_TEMPERATURE = 2.0  # vLLM's and OpenAI's upper bound


@dataclasses.dataclass(frozen=True)
class Range:
    """An interval of allowed values: ``[lo, hi]`` with either end open, of ints or of real numbers. ``str()`` is
    how errors and docs/sampling.md write it (``(0, 1]``, ``[-1, inf)``); NaN is in no range, and an end at
    +-inf is always open (so the values are finite)."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False  # None is allowed too (off / random)

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{_bound(self.lo)}, {_bound(self.hi)}{')' if self.hi_open else ']'}"

    def contains(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below and (isinstance(value, int) or math.isfinite(value))

    def check(self, name: str, value: Any) -> int | float:
        """``value`` as a plain int / float, or a ValueError naming ``name`` and the range."""
        kind = "an int" if self.integer else "a number"
        number = _integer(name, value, self.optional) if self.integer else _number(name, value)
        if not self.contains(number):
            raise ValueError(f"{name}: expected {kind} in {self}{' or None' if self.optional else ''}, got {value!r}")
        return number


def _bound(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == SEED_MAX:
        return "2**63 - 1"
    return str(int(value)) if float(value).is_integer() else str(value)


_INF = math.inf
# every numeric field of SamplingParams and its allowed values (vLLM's ranges; docs/sampling.md has the table)
RANGES: dict[str, Range] = {
    "temperature": Range(0, MAX_TEMPERATURE),
    "top_p": Range(0, 1, lo_open=True),
    "top_k": Range(-1, _INF, hi_open=True, integer=True),
    "min_p": Range(0, 1),
    "presence_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Range(0, _INF, lo_open=True, hi_open=True),
    "seed": Range(0, SEED_MAX, integer=True, optional=True),
    "max_tokens": Range(1, _INF, hi_open=True, integer=True),
    "logprobs": Range(0, _INF, hi_open=True, integer=True, optional=True),
    "prompt_logprobs": Range(0, _INF, hi_open=True, integer=True, optional=True),
    "thinking_token_budget": Range(0, _INF, hi_open=True, integer=True, optional=True),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature:    0 = greedy (argmax); a number in (0, 2] scales the logits before sampling.
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
    kv_transfer_params: prefill/decode disaggregation, vLLM's convention: ``{"do_remote_decode": true}`` asks a
                        kv_producer to publish the prompt's cache; the producer's answer (``remote_transfer_id``,
                        ``remote_num_tokens``, ``remote_host``, ``remote_port``) given to a kv_consumer makes it
                        fetch that cache instead of computing the prompt. None = off.

    Numbers may be Python or numpy / other ``numbers`` scalars (stored as int / float); a value of the wrong type
    or outside its :data:`RANGES` entry raises ValueError naming the field and the range.
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
    kv_transfer_params: dict[str, Any] | None = dataclasses.field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        # store plain ints / floats / tuples, so the params stay hashable and the sampler sees Python numbers
        def set_(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        set_("stop", _stop_strings(self.stop))
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params: expected a dict or None, got "
                             f"{type(self.kv_transfer_params).__name__}")
        set_("stop_token_ids", _stop_ids(self.stop_token_ids))
        for name, bounds in RANGES.items():
            value = getattr(self, name)
            if value is not None or not bounds.optional:
                set_(name, bounds.check(name, value))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens: expected a bool, got {self.skip_special_tokens!r}")
        self._check_structured()

    def _check_structured(self) -> None:
        if not isinstance(self.prompt_in_think, bool):
            raise ValueError(f"prompt_in_think: expected a bool, got {self.prompt_in_think!r}")
        budget = self.thinking_token_budget
        if budget is not None:
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
