"""The OpenAI-compatible request and response bodies (pydantic).

Requests follow vLLM: fields the server does not know are accepted and ignored (logged), but a known field with
a wrong type or a bad value is a 400 naming the field. Value ranges are checked once, where the values become a
:class:`~rocm_k3.sampling_params.SamplingParams` or a chat prompt (the error names the field there); the models
check types. Extensions beyond OpenAI's fields are vLLM's: ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``return_token_ids``, ``structured_outputs`` (and its
older spellings ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``),
``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``, ``thinking_token_budget``,
``prompt_logprobs``, ``stream_options.continuous_usage_stats``. Every field is in
``docs/openai_compat.md`` (supported, refused with a 400, or ignored by design), which a test keeps in step.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

StrictBool = Annotated[bool, Strict()]


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class OpenAIBody(BaseModel):
    """Unknown fields are kept (``model_extra``) so the server can name them in a warning (vLLM's way).

    ``REFUSED``: OpenAI fields this server does not serve and must not drop silently (name -> why): sent with a
    value other than null (or one of ``ALLOWED_VALUES[name]``) they are a 400 naming the field. ``IGNORED``:
    OpenAI fields accepted without effect by design (docs/openai_compat.md gives each reason), so not warned of.
    """

    model_config = ConfigDict(extra="allow")
    REFUSED: ClassVar[dict[str, str]] = {}
    ALLOWED_VALUES: ClassVar[dict[str, list[Any]]] = {}
    IGNORED: ClassVar[frozenset[str]] = frozenset()

    def refused_field(self) -> tuple[str, str] | None:
        """(name, why) of the first refused field sent with a value, or None."""
        extra = self.model_extra or {}
        for name, why in self.REFUSED.items():
            value = extra.get(name)
            if value is not None and value not in self.ALLOWED_VALUES.get(name, []):
                return name, why
        return None

    def unknown_fields(self) -> list[str]:
        return sorted(set(self.model_extra or ()) - set(self.REFUSED) - self.IGNORED)


# ---- requests -----------------------------------------------------------------------------------------------
class StreamOptions(OpenAIBody):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage (so far) on every chunk


class JsonSchemaFormat(OpenAIBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any]:
        """The form the chat renderer and the constraint builder read."""
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_,
                                  "strict": self.json_schema.strict}
        return out


class SamplingRequest(OpenAIBody):
    """The fields both completion APIs share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool | None = None
    logit_bias: dict[str, float] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: StrictBool = False
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode disaggregation (vLLM's convention)

    def structured_request(self) -> tuple[dict[str, Any] | None, str]:
        """(the ``structured_outputs`` object, the field it came from): vLLM's older ``guided_json`` /
        ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extras are that object's json / regex / choice /
        grammar. ValueError when more than one is given."""
        guided = {f: getattr(self, f) for f in GUIDED_FIELDS if getattr(self, f) is not None}
        if not guided:
            return self.structured_outputs, "structured_outputs"
        if len(guided) > 1 or self.structured_outputs is not None:
            given = [*guided, *(["structured_outputs"] if self.structured_outputs is not None else [])]
            raise ValueError(f"{given[0]}: give only one of structured_outputs, {', '.join(GUIDED_FIELDS)}; "
                             f"got {given}")
        ((field, value),) = guided.items()
        return {GUIDED_FIELDS[field]: value}, field


class CompletionRequest(SamplingRequest):
    IGNORED: ClassVar[frozenset[str]] = frozenset({"user"})

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatPromptFields(OpenAIBody):
    """What renders a chat prompt: shared by ``/v1/chat/completions`` and ``/tokenize`` (one rendering path)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False


class ChatCompletionRequest(SamplingRequest, ChatPromptFields):
    REFUSED: ClassVar[dict[str, str]] = {
        "audio": "audio output is not served",
        "modalities": "only text output is served",
        "functions": "legacy function calling: send tools",
        "function_call": "legacy function calling: send tool_choice",
        "web_search_options": "no web search is served",
    }
    ALLOWED_VALUES: ClassVar[dict[str, list[Any]]] = {"modalities": [["text"]]}
    IGNORED: ClassVar[frozenset[str]] = frozenset({
        "user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "safety_identifier", "verbosity", "prediction", "moderation"})
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    thinking_token_budget: int | None = None


class TokenizeRequest(ChatPromptFields):
    """Either ``prompt`` (text) or ``messages`` (a chat, rendered exactly as the chat API renders it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(OpenAIBody):
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------------------------
# Every response model carries every key of OpenAI's schema (``null`` where it has no value: the server dumps
# them without excluding None), so clients that index keys directly find them; vLLM's extras come as keys too.
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    audio_tokens: int | None = None
    image_tokens: int | None = None
    text_tokens: int | None = None
    cache_write_tokens: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: dict[str, int] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    reasoning_content: str | None = None


class _ChatChoiceCommon(BaseModel):
    """What a whole chat choice and a stream chunk's choice share (the message / delta is each one's own)."""

    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatChoice(_ChatChoiceCommon):
    message: ChatMessage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: DeltaFunctionCall | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(_ChatChoiceCommon):
    delta: DeltaMessage


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry of one candidate token (keyed by its id as a string)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


def _now() -> int:
    return int(time.time())


class _CompletionObject(BaseModel):
    """How every completion object sent (a chat response or chunk, a text completion) starts; each names its
    ``object`` and adds its choices and the rest."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str


class ChatCompletionResponse(_CompletionObject):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    moderation: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a kv_producer's answer: where to fetch the prompt's cache


class ChatCompletionChunk(_CompletionObject):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None
    moderation: dict[str, Any] | None = None
    obfuscation: str | None = None


class CompletionResponse(_CompletionObject):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a kv_producer's answer: where to fetch the prompt's cache


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "rocm-k3"
    root: str | None = None
    max_model_len: int | None = None
    shutdown_date: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
