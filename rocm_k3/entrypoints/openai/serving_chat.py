"""``POST /v1/chat/completions``: a conversation rendered in the checkpoint's chat format, n choices, the output
parsed into ``reasoning_content``, ``content`` and ``tool_calls`` (``finish_reason`` "tool_calls" when the turn
stopped with calls), streamed as server-sent events (reasoning, content and tool-call deltas the vLLM way: index,
id, type and name first, then the arguments JSON text as the model writes it) or answered whole. Tools, tool_choice, response_format, structured_outputs and thinking are
prepared by :mod:`rocm_k3.engine.chat` (shared with ``LLM.chat``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from rocm_k3.engine.chat import ChatRequest, PreparedChat, chat_finish_reason, structured_outputs_from
from rocm_k3.entrypoints.openai.errors import APIError, bad_request
from rocm_k3.formats.parsers import ToolCall
from rocm_k3.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatPromptFields,
    ChatLogprobs,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
)
from rocm_k3.entrypoints.openai.serving_common import (ChoiceState, ServedModel, chat_logprobs, chunk_stream,
    check_range, collect, choice_params, error_event, failed_choice, merge_streams, new_request_id, sampling_params,
    sse, start_streams, structured_outputs_of, usage, usage_every_chunk, vllm_prompt_logprobs)
from rocm_k3.sampling_params import RANGES, SamplingParams


def _tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments_json))


class ChatRun:
    """One validated chat request, ready to run (see :func:`prepare_chat`)."""

    def __init__(self, served: ServedModel, req: ChatCompletionRequest, model: str, prepared: PreparedChat,
                 params: SamplingParams, prompt: list[int], images: tuple = ()) -> None:
        self.served, self.req, self.model, self.prepared = served, req, model, prepared
        self.prompt, self.images = prompt, images
        self.params = choice_params(params, req.n)
        self.request_id = new_request_id("chatcmpl")
        self.top = params.logprobs
        self._choices: list[ChoiceState] = []  # the streamed choices so far (usage on every chunk)

    def _call_prefix(self, i: int) -> str:
        return f"call_{self.request_id[9:25]}_{i}_"

    async def _streams(self):
        prompt = self.prompt
        streams = await start_streams(self.served, self.request_id, [prompt] * len(self.params), self.params,
                                      self.images, field="messages")
        self.served.metrics.prompt_tokens.inc(len(prompt) * len(self.params))
        return streams

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> ChatLogprobs | None:
        if self.top is None:
            return None
        return ChatLogprobs(content=chat_logprobs(self.served.tokenizer, token_ids, entries, self.top))

    def _usage(self, choices: list[ChoiceState]):
        return usage(len(self.prompt), sum(len(c.token_ids) for c in choices),
                     choices[0].cached if choices else 0)

    async def respond(self) -> ChatCompletionResponse:
        streams = await self._streams()
        choices = await collect(self.served, streams)
        out = []
        for i, c in enumerate(choices):
            parsed = self.prepared.parse(c.text, call_id_prefix=self._call_prefix(i))
            message = ChatMessage(content=parsed.content, reasoning_content=parsed.reasoning,
                                  tool_calls=[_tool_call_out(t) for t in parsed.tool_calls])
            out.append(ChatChoice(index=i, message=message, logprobs=self._logprobs(c.token_ids, c.logprobs),
                                  finish_reason=chat_finish_reason(c.finish_reason, bool(parsed.tool_calls)),
                                  token_ids=c.token_ids if self.req.return_token_ids else None))
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=out, usage=self._usage(choices),
            prompt_token_ids=self.prompt if self.req.return_token_ids else None,
            prompt_logprobs=vllm_prompt_logprobs(self.served.tokenizer, self.prompt, choices[0].prompt_logprobs,
                                                 choices[0].prompt_ranks, self.req.prompt_logprobs),
            kv_transfer_params=choices[0].kv_transfer_params if choices else None)

    async def stream(self) -> AsyncIterator[str]:
        streams = await self._streams()
        return chunk_stream(self._events(streams), self.req, lambda: ChatCompletionChunk(
            id=self.request_id, model=self.model, choices=[], usage=self._usage(self._choices)))

    def _chunk(self, i: int, delta: DeltaMessage, *, finish_reason: str | None = None, logprobs=None,
               token_ids: list[int] | None = None) -> str:
        choice = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                 token_ids=token_ids if self.req.return_token_ids else None)
        running = self._usage(self._choices) if usage_every_chunk(self.req) else None
        return sse(ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice], usage=running))

    async def _events(self, streams) -> AsyncIterator[str]:
        choices = self._choices = [ChoiceState() for _ in streams]
        parsers = [self.prepared.parser(self._call_prefix(i)) for i in range(len(streams))]
        timers = [self.served.metrics.timer() for _ in streams]
        if self.req.return_token_ids:
            yield sse(ChatCompletionChunk(id=self.request_id, model=self.model, choices=[],
                                          prompt_token_ids=self.prompt))
        for i in range(len(streams)):
            yield self._chunk(i, DeltaMessage(role="assistant", content=""))
        async for i, delta in merge_streams(streams):
            timers[i].on_delta(delta)
            c = choices[i]
            c.add(delta, text=False)
            if delta.finish_reason == "error":
                yield error_event(failed_choice(i, delta))
                continue
            parsed = parsers[i].feed(delta.new_text)
            if delta.finished:
                tail = parsers[i].finish()
                parsed.reasoning = _join(parsed.reasoning, tail.reasoning)
                parsed.content = _join(parsed.content, tail.content)
                parsed.tool_calls += tail.tool_calls
                parsed.call_deltas += tail.call_deltas
            c.num_calls += len(self.prepared.allowed_calls(parsed.tool_calls, c.num_calls))
            tool_deltas = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
                           for d in self.prepared.allowed_call_deltas(parsed.call_deltas)]
            lp = self._logprobs(delta.new_token_ids, delta.new_logprobs) if delta.new_logprobs else None
            body = DeltaMessage(content=parsed.content, reasoning_content=parsed.reasoning,
                                tool_calls=tool_deltas or None)
            has_text = parsed.content is not None or parsed.reasoning is not None or tool_deltas
            if has_text or lp is not None or (delta.new_token_ids and self.req.return_token_ids):
                yield self._chunk(i, body, logprobs=lp, token_ids=delta.new_token_ids)
            if delta.finished:
                c.finish_reason = chat_finish_reason(delta.finish_reason, c.num_calls > 0)
                yield self._chunk(i, DeltaMessage(), finish_reason=c.finish_reason)


def _join(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    return a if b is None else a + b


def chat_prompt(served: ServedModel, req: ChatPromptFields, remote: dict[str, bytes] | None = None, *,
                structured_outputs=None, thinking_token_budget: int | None = None) -> tuple[PreparedChat, list[int], tuple]:
    """The one rendering of a chat request, for ``/v1/chat/completions`` and ``/tokenize`` alike: the prepared
    chat, the prompt ids the engine runs (image blocks inserted) and the images; 400 naming the field.
    ``remote``: the fetched http(s) images (:func:`fetch_remote_images`; None: refused)."""
    chat = ChatRequest(
        req.messages, tools=req.tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=req.response_format.as_dict() if req.response_format is not None else None,
        structured_outputs=structured_outputs, chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning_effort, thinking_token_budget=thinking_token_budget,
        add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message)
    try:
        prepared = served.frontend.prepare_chat(chat, enable_auto_tool_choice=served.enable_auto_tool_choice,
                                                allow_images=True)
        prompt, images = _with_images(served, req, prepared, remote)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc, "messages") from None
    return prepared, prompt, images


def prepare_chat(served: ServedModel, req: ChatCompletionRequest, remote: dict[str, bytes] | None = None) -> ChatRun:
    """Check and render a chat request (404 / 400 / 503 raised here, before any output)."""
    model = served.check_model(req.model)
    served.check_alive()
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs: not returned in chat streams (send stream=false, or use "
                       "/v1/completions, whose stream carries them)", param="prompt_logprobs")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
        check_range("top_logprobs", req.top_logprobs)
    prepared, prompt, images = chat_prompt(served, req, remote, structured_outputs=structured_outputs_of(req),
                                           thinking_token_budget=req.thinking_token_budget)
    if req.max_completion_tokens is not None:  # named here: SamplingParams would call it max_tokens
        try:
            RANGES["max_tokens"].check("max_completion_tokens", req.max_completion_tokens)
        except ValueError as exc:
            raise bad_request(exc) from None
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = limit if limit is not None else max(1, served.max_model_len - len(prompt) + 1)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=top, **prepared.sampling_changes())
    return ChatRun(served, req, model, prepared, params, prompt, images)


def _with_images(served: ServedModel, req: ChatPromptFields, prepared: PreparedChat,
                 remote: dict[str, bytes] | None) -> tuple[list[int], tuple]:
    """The prompt ids with each image's block inserted, and the images (ValueError -> 400 for a bad or refused
    image, or images sent to a model without a vision tower); ``remote``: the fetched http(s) images
    (:func:`fetch_remote_images`; None: refused)."""
    if not prepared.image_positions:
        return list(prepared.prompt_token_ids), ()
    if served.multimodal is None:
        raise ValueError(f"this model takes no images ({len(prepared.image_positions)} image part(s) sent)")
    from rocm_k3.engine.chat_images import images_from_messages
    from rocm_k3.engine.multimodal import named_image_error
    from rocm_k3.model.vision.preprocess import ImageError
    from rocm_k3.model.vision.prompt import ImagePlacementError, MediaTokenInPromptError

    pictures = images_from_messages(req.messages, remote=remote, max_bytes=served.max_image_bytes)
    try:
        mm = served.multimodal.process_images(prepared.prompt_token_ids, prepared.image_positions, pictures)
    except (ImageError, ImagePlacementError, MediaTokenInPromptError) as exc:
        raise named_image_error(exc, "messages") from exc
    return mm.token_ids, mm.images
