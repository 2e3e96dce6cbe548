"""Named errors of the cache and scheduler configuration, and of requests that can never be served.

All derive from :class:`ValueError`, so callers that only care about "bad input" can catch that.
"""

from __future__ import annotations


class CacheConfigError(ValueError):
    """Base class: a cache or scheduler configuration that cannot work."""


class MatchUnitError(CacheConfigError):
    """The prefix match unit does not divide the physical block size, or is off the KDA state-save grid."""


class AlignmentError(CacheConfigError):
    """The scheduler alignment is not a multiple of the prefix match unit."""


class CacheBudgetError(CacheConfigError):
    """The KV or KDA-state memory budget cannot hold even one request of the maximum length."""


class TokenBudgetError(CacheConfigError):
    """``max_num_batched_tokens`` is too small for an aligned prefill chunk next to a full batch of decodes."""


class RequestTooLargeError(ValueError):
    """A request that no amount of waiting or preemption can make fit (too long for the model or the cache)."""


class PromptTooLongError(RequestTooLargeError):
    """A prompt with more tokens than the model's ``max_model_len``."""


def check_prompt_length(num_tokens: int, max_model_len: int, where: str) -> None:
    """The one prompt-length check (the engine core runs it on every request): PromptTooLongError naming
    ``where`` when the prompt does not fit."""
    if num_tokens > max_model_len:
        raise PromptTooLongError(f"{where}: {num_tokens} tokens exceed max_model_len={max_model_len}, this model's "
                                 "maximum context length; reduce the length of the input")
