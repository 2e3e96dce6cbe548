"""What ``rocm_k3.LLM.generate`` returns per prompt."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt.

    prompt_token_ids: the prompt as token ids (encoded when a text prompt was given).
    token_ids:        the generated token ids (a stop token is included; nothing after it).
    text:             the generated ids decoded (cut before a matched stop string; "" without a tokenizer).
    logprobs:         per generated token ``{token_id: logprob}`` (chosen token first, then the top
                      alternatives) when SamplingParams.logprobs is set, else None.
    finish_reason:    "stop" (eos, stop token or stop string) or "length" (max_tokens or max_model_len).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str
