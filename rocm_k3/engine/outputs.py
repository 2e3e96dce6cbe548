"""What the engine returns: the final :class:`RequestOutput` of a request and the per-step :class:`RequestDelta`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt.

    prompt_token_ids:  the prompt as token ids (encoded when a text prompt was given).
    token_ids:         the generated token ids (a stop token is included; nothing after it).
    text:              the generated ids decoded (cut before a matched stop string; "" without a tokenizer).
    logprobs:          per generated token ``{token_id: logprob}`` (chosen token first, then the top
                       alternatives) when SamplingParams.logprobs is set, else None.
    finish_reason:     "stop" (eos, stop token or stop string), "length" (max_tokens or max_model_len),
                       "abort", or "error" (see ``error``).
    error:             why the request failed (finish_reason "error"), e.g. non-finite logits; else None.
    num_cached_tokens: prompt tokens served from the prefix cache at the request's last admission.
    prompt_logprobs:   with SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
                       ``{token_id: logprob}`` (the prompt token first, then the top alternatives); else None.
    prompt_logprob_ranks: the prompt tokens' ranks in their distributions (1 = most likely; None for the first).
    kv_transfer_params: a kv_producer's answer to ``do_remote_decode``: where a decode instance fetches the
                       prompt's cache (vLLM's convention); else None.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    kv_transfer_params: dict | None = None


@dataclasses.dataclass
class RequestDelta:
    """What one step added to a request (for streaming): new token ids and text, and the final output once done.

    new_text holds back a tail that could still become a stop string; it is released when the request finishes.
    prompt_logprobs / prompt_logprob_ranks: on the request's first delta, as in :class:`RequestOutput`.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    error: str | None
    output: RequestOutput | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
