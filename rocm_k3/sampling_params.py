"""Sampling parameters of one request (validated), as in ``rocm_k3.LLM.generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature:    0 = greedy (argmax); > 0 scales the logits before sampling.
    top_k:          keep the k most likely tokens (0 or -1 = all).
    top_p:          keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = all).
    seed:           seeds this request's own generator (same seed, same prompt -> same tokens); None = random.
    max_tokens:     at most this many generated tokens.
    stop_token_ids: generation stops after emitting one of these (it is kept in the output ids).
    stop:           generation stops when the text contains one of these strings (the text is cut before it).
    logprobs:       None, or the number of most likely alternatives to report per generated token (0 = only
                    the chosen token's log-probability); log-probabilities are of the model's distribution.
    ignore_eos:     keep generating past the model's end-of-sequence token.
    skip_special_tokens: leave special tokens (e.g. ``<|end_of_msg|>``) out of the output text (the ids stay).
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
