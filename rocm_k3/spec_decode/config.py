"""``--speculative-config``: vLLM's JSON keys, validated.

Keys: ``method`` ("ngram"), ``num_speculative_tokens`` (1..8), ``prompt_lookup_min`` / ``prompt_lookup_max``
(n-gram sizes tried, longest first). Unknown keys are refused with their names.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: expected one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name}: expected a positive int, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON object string (the CLI flag), a dict (the LLM kwarg) or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config: expected a JSON object or dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**dict(value))
