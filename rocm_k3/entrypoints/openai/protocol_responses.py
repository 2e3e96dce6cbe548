"""The request body of ``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it).

``input`` is a string (one user message) or a list of items (messages, ``function_call``,
``function_call_output``, ``reasoning``); see :mod:`serving_responses` for how they become a chat. Unknown fields
are kept (``model_extra``) and named in a warning, as for the other routes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rocm_k3.entrypoints.openai.protocol import OpenAIBody, StrictBool


class ResponsesRequest(OpenAIBody):
    REFUSED: ClassVar[dict[str, str]] = {
        "conversation": "the Conversations API is not served: send previous_response_id or the whole input",
        "prompt": "stored prompt templates are not served: send instructions and input",
        "max_tool_calls": "tool-call limits are not enforced: run the tool loop in the client",
        "top_logprobs": "the responses API returns no logprobs here: use /v1/chat/completions",
    }
    IGNORED: ClassVar[frozenset[str]] = frozenset({
        "include", "service_tier", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
        "safety_identifier", "stream_options", "moderation", "background_options", "access_programs",
        "context_management", "image"})
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    metadata: dict[str, str] | None = None
    stream: StrictBool = False
    store: StrictBool = True
    background: StrictBool = False
    previous_response_id: str | None = None
    user: str | None = None
    truncation: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    ignore_eos: StrictBool = False
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode disaggregation (as on chat and completions)
