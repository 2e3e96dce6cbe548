"""Sampling parameters of one request (validated), as in ``rocm_k3.LLM.generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import Any

SEED_MAX = 2**63 - 1  # seeds are non-negative 63-bit ints (a negative seed must not alias 2**64 + seed)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature:    0 = greedy (argmax); a finite number > 0 scales the logits before sampling.
    top_k:          keep the k most likely tokens (0 or -1 = all).
    top_p:          keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = all).
    seed:           seeds this request's own generator (same seed, same prompt -> same tokens), an int in
                    [0, 2**63 - 1]; None = random.
    max_tokens:     at most this many generated tokens.
    stop_token_ids: generation stops after emitting one of these (it is kept in the output ids); None = none.
    stop:           generation stops when the text contains one of these strings (the text is cut before it);
                    a single string or None are accepted.
    logprobs:       None, or the number of most likely alternatives to report per generated token (0 = only
                    the chosen token's log-probability); log-probabilities are of the model's distribution.
    ignore_eos:     keep generating past the model's end-of-sequence token.
    skip_special_tokens: leave special tokens (e.g. ``<|end_of_msg|>``) out of the output text (the ids stay).

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
    ignore_eos: bool = False
    skip_special_tokens: bool = True

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
        if self.logprobs is not None:
            logprobs = _integer("logprobs", self.logprobs, or_none=True)
            if logprobs < 0:
                raise ValueError(f"logprobs: expected None or an int >= 0, got {self.logprobs!r}")
            set_("logprobs", logprobs)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens: expected a bool, got {self.skip_special_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
