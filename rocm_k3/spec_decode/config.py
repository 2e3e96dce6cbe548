"""``--speculative-config``: vLLM's JSON keys, validated.

Keys: ``method`` ("ngram" or "draft_model"), ``num_speculative_tokens`` (1..8), ``prompt_lookup_min`` /
``prompt_lookup_max`` (n-gram sizes tried, longest first), ``model`` (draft_model: a drafter directory, a Hugging
Face repo id found in the local Hugging Face cache, or "embedded-drafter" for the one shipped beside the embedded
tiny K3; rocm-k3's tap drafter or a K3 DSpark checkpoint, e.g. "Inferact/Kimi-K3-DSpark"), ``revision`` (of a repo id: branch, tag or commit hash), ``disable_by_batch_size`` (no drafts in a step
that decodes at least this many sequences: wide verifications cost more than they win at large batches, see
benchmarks/RESULTS.md; None: always draft). Unknown keys are refused with their names;
vLLM's other methods (eagle, eagle3, mtp, medusa, ...) are refused by name: rocm-k3's hidden-state drafter (the
EAGLE / DSpark shape) is ``draft_model``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 8
EMBEDDED_DRAFTER = "embedded-drafter"  # the model name of the drafter shipped beside the embedded tiny K3


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    revision: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: expected one of {METHODS}, got {self.method!r} (a drafter "
                             "that reads the target's hidden states, EAGLE / DSpark style, is method 'draft_model')")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model: method 'draft_model' needs the drafter's directory (or "
                                 f"{EMBEDDED_DRAFTER!r}), got {self.model!r}")
        elif self.model is not None:
            raise ValueError(f"speculative_config.model: method {self.method!r} takes no draft model, got "
                             f"{self.model!r}")
        if self.revision is not None and (self.model is None or not isinstance(self.revision, str)
                                          or not self.revision):
            raise ValueError(f"speculative_config.revision: expected a non-empty string with a draft model "
                             f"(model={self.model!r}), got {self.revision!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name}: expected a positive int, got {value!r}")
        cut = self.disable_by_batch_size
        if cut is not None and (isinstance(cut, bool) or not isinstance(cut, int) or cut < 2):
            raise ValueError(f"speculative_config.disable_by_batch_size: expected an int >= 2 or null, got {cut!r}")
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

    def drafts_at(self, num_decoding: int) -> bool:
        """Whether a step that decodes ``num_decoding`` sequences drafts at all (``disable_by_batch_size``)."""
        return self.disable_by_batch_size is None or num_decoding < self.disable_by_batch_size

    def check_pipeline(self, pipeline_parallel_size: int) -> None:
        """ValueError naming the combination when this method cannot run over ``pipeline_parallel_size`` stages:
        the drafter reads the target's hidden states at layers that pipeline parallelism puts on other stages."""
        if self.method == "draft_model" and pipeline_parallel_size > 1:
            raise ValueError(f"speculative_config: method 'draft_model' with pipeline_parallel_size="
                             f"{pipeline_parallel_size} is not supported: the drafter reads hidden states from layers "
                             "across the whole model, which pipeline parallelism splits over stages; use "
                             "pipeline_parallel_size 1 or method 'ngram'")
