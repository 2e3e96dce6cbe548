"""What the completion and chat handlers share: the served model, request checks, sampling parameters from the
request fields, running n choices on the engine (merged streams, aborts), logprobs, usage and server-sent events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from rocm_k3.cache.errors import PromptTooLongError
from rocm_k3.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from rocm_k3.engine.chat import ModelFrontend
from rocm_k3.engine.outputs import RequestDelta
from rocm_k3.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from rocm_k3.entrypoints.openai.metrics import ServerMetrics
from rocm_k3.entrypoints.openai.request_ids import engine_request_id
from rocm_k3.entrypoints.openai.protocol import (
    GUIDED_FIELDS,
    CompletionLogprobs,
    OpenAIBody,
    PromptLogprob,
    PromptTokensDetails,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from rocm_k3.formats.json_limits import JSONLimitError, load_json
from rocm_k3.sampling_params import Range, SamplingParams

log = logging.getLogger("rocm_k3.server")

MAX_LOGPROBS = 20
MAX_N = 128
SEED_MODULUS = 2**63
# the server's own limits on request fields, beyond SamplingParams.RANGES (docs/sampling.md has the table)
SERVER_RANGES: dict[str, Range] = {
    "n": Range(1, MAX_N, integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "top_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
}


def check_range(name: str, value: Any) -> None:
    """400 naming ``name`` and its range when ``value`` is outside :data:`SERVER_RANGES`."""
    try:
        SERVER_RANGES[name].check(name, value)
    except ValueError as exc:
        raise APIError(400, str(exc), param=name) from None


@dataclasses.dataclass
class ServedModel:
    """Everything the handlers need: the engine, the request side of the model, names, limits and metrics."""

    engine: AsyncLLM
    frontend: ModelFrontend
    names: list[str]
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    api_key: str | None = None
    enable_auto_tool_choice: bool = False
    max_request_bytes: int = 32 * 2**20
    multimodal: Any = None  # MultiModalProcessor of a checkpoint with a vision tower, else None
    image_fetcher: Any = None  # ImageFetcher with --allow-remote-images (entrypoints/image_fetch.py), else None
    max_image_bytes: int = 20 * 2**20
    responses_store_size: int = 1000
    draining: bool = False  # set on SIGTERM / SIGINT: running requests finish, new ones get 503 + Retry-After

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    def check_model(self, name: str | None) -> str:
        """The model name to answer with; 404 for a name this server does not serve."""
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise APIError(404, f"The model `{name}` does not exist (this server serves {self.names})", param="model")
        return name

    def check_alive(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.engine.is_dead:
            raise APIError(503, f"the engine has failed ({self.engine.dead_reason}); restart the server")


async def read_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The request body as ``model``: 413 past ``limit`` bytes, 400 for bad JSON or a bad field (named)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        data = load_json(b"".join(chunks), "request body")  # depth, number, NaN and surrogate limits
    except JSONLimitError as exc:
        raise APIError(400, str(exc)) from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body: expected a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    refused = body.refused_field() if isinstance(body, OpenAIBody) else None
    if refused is not None:
        raise APIError(400, f"{refused[0]}: not supported by this server ({refused[1]})", param=refused[0])
    unknown = body.unknown_fields() if isinstance(body, OpenAIBody) else sorted(body.model_extra or ())
    if unknown:
        log.warning("%s: ignoring unknown fields %s", request.url.path, unknown)
    return body


async def fetch_remote_images(served: ServedModel, messages: Sequence[Any]) -> dict[str, bytes] | None:
    """The bytes of the http(s) image URLs of ``messages``, fetched in the server's image fetch pool within one
    deadline (None when this server does not fetch: rendering then refuses them); 400 naming the image part and
    the problem (refused host, timeout, too large, bad answer)."""
    if served.image_fetcher is None or served.multimodal is None:
        return None
    from rocm_k3.engine.chat_images import remote_image_urls
    from rocm_k3.entrypoints.image_fetch import ImageFetchError

    try:
        return await served.image_fetcher.fetch_all(remote_image_urls(messages))
    except ImageFetchError as exc:
        raise bad_request(exc, "messages") from None


def new_request_id(prefix: str) -> str:
    """The engine request id of the request being handled: ``{prefix}-{x-request-id}`` (see ``request_ids``)."""
    return engine_request_id(prefix)


def sampling_params(req: SamplingRequest, *, max_tokens: int, logprobs: int | None,
                    skip_special_tokens: bool, **changes: Any) -> SamplingParams:
    """The request's SamplingParams, built (and validated) once from its fields plus ``changes`` (the chat's
    or the completion's constraint fields); 400 naming the field for a bad value."""
    if req.logit_bias:
        raise APIError(400, "logit_bias: not supported by this server", param="logit_bias")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if value is not None:
            check_range(name, value)
    check_range("n", req.n)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    values: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "seed": req.seed, "max_tokens": max_tokens, "stop": tuple(stop),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "logprobs": logprobs, "ignore_eos": req.ignore_eos,
        "prompt_logprobs": req.prompt_logprobs,
        "skip_special_tokens": skip_special_tokens if req.skip_special_tokens is None else req.skip_special_tokens,
        "kv_transfer_params": req.kv_transfer_params,
    }
    values.update(changes)
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None


def structured_outputs_of(req: SamplingRequest) -> Any:
    """``structured_outputs``, or vLLM's older ``guided_*`` fields, as one StructuredOutputs (None when none is sent);
    a 400 naming the field when two are sent or the value is bad (a schema keyword the grammar cannot enforce,
    an empty choice, ...)."""
    from rocm_k3.engine.chat import structured_outputs_from

    field = "structured_outputs"
    try:
        value, field = req.structured_request()
        return structured_outputs_from(value, field)
    except (ValueError, TypeError) as exc:
        named = str(exc).split(":", 1)[0].split(".", 1)[0]
        raise APIError(400, str(exc), param=named if named in (*GUIDED_FIELDS, "structured_outputs") else field) \
            from None


def usage_every_chunk(req: SamplingRequest) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of n choices: seeds seed, seed + 1, ... when a seed is given (reproducible), else random."""
    if params.seed is None or n == 1:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % SEED_MODULUS) for i in range(n)]


async def start_streams(served: ServedModel, request_id: str, prompts: Sequence[Sequence[int]],
                        params: Sequence[SamplingParams], images: Sequence[Any] = (), *,
                        field: str = "prompt") -> list[RequestStream]:
    """Queue one engine request per (prompt, params) pair (ids ``{request_id}-{i}``); all or none: a refused one
    aborts those already queued. 400 for a bad request (the engine's checks, a too long prompt naming ``field``),
    503 when the engine is dead."""
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(await served.engine.add_request(f"{request_id}-{i}", ids, p, images=images))
    except BaseException as exc:
        for s in streams:
            s.close()
        if isinstance(exc, EngineDeadError):
            raise APIError(503, str(exc)) from None
        if isinstance(exc, (ValueError, TypeError)):
            raise bad_request(exc, field if isinstance(exc, PromptTooLongError) else None) from None
        raise
    return streams


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(choice index, delta) from all streams as they come; leaving early (or being cancelled) aborts every
    unfinished stream. An engine failure ends it with a 503 APIError."""
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer)
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, EngineDeadError):
                raise APIError(503, str(item))
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (for handlers that answer with one response at the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Await ``work`` (a coroutine), cancelling it when the client disconnects first (its requests abort; one INFO
    line says so)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        log.info("%s: the client disconnected; its request was aborted", request.url.path)
        raise APIError(499, "the client disconnected")
    return task.result()


async def logged_stream(events: AsyncGenerator[str, None], path: str) -> AsyncIterator[str]:
    """``events`` as they come; when the stream is cancelled (the client disconnected, or a second signal ended
    the server) one INFO line says so, and no traceback follows (the engine requests abort as the stream ends)."""
    try:
        async for event in events:
            yield event
    except (asyncio.CancelledError, GeneratorExit):  # cancelled mid-await, or closed unfinished at a yield
        log.info("%s: the stream was cancelled (client disconnected or server stopped); its request was aborted",
                 path)
        raise
    finally:
        await events.aclose()  # its engine requests abort now, not when the generator is collected


async def chunk_stream(events: AsyncGenerator[str, None], req: SamplingRequest,
                       usage_chunk: Callable[[], BaseModel]) -> AsyncIterator[str]:
    """A chat or completions stream: ``events`` (the choices' chunks), then ``usage_chunk()`` (no choices, the whole
    request's usage) when ``stream_options`` asks for it, then ``[DONE]``; an APIError raised on the way is sent as
    an error event before ``[DONE]``."""
    try:
        async for event in events:
            yield event
        opts = req.stream_options
        if opts is not None and (opts.include_usage or opts.continuous_usage_stats):
            yield sse(usage_chunk())
    except APIError as exc:
        yield error_event(exc)
    finally:
        await events.aclose()
    yield SSE_DONE


@dataclasses.dataclass
class ChoiceState:
    """One choice as its deltas arrive: tokens, text, logprobs, how it finished, calls sent (chat streaming)."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    cached: int = 0
    num_calls: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs, first delta
    prompt_ranks: list[int | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, delta: RequestDelta, *, text: bool = True) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = delta.prompt_logprobs, delta.prompt_logprob_ranks
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.new_logprobs or []
        if text:
            self.text += delta.new_text
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.cached = delta.output.num_cached_tokens if delta.output is not None else 0
            self.kv_transfer_params = delta.output.kv_transfer_params if delta.output is not None else None


async def collect(served: ServedModel, streams: Sequence[RequestStream]) -> list[ChoiceState]:
    """Every choice to its end (for answers sent whole); a failed choice is a 500."""
    choices = [ChoiceState() for _ in streams]
    timers = [served.metrics.timer() for _ in streams]
    async for i, delta in merge_streams(streams):
        timers[i].on_delta(delta)
        choices[i].add(delta)
        if delta.finish_reason == "error":
            raise failed_choice(i, delta)
    return choices


def failed_choice(index: int, delta: RequestDelta) -> APIError:
    return APIError(500, f"choice {index} failed: {delta.error}")


def error_event(exc: APIError) -> str:
    """An error inside a stream that has started (the status line is sent): an SSE event the openai client raises."""
    return sse({"error": {"message": exc.message, "type": "internal_error" if exc.status == 500 else
                          "service_unavailable", "param": None, "code": exc.status}})


def sse(body: BaseModel | dict) -> str:
    if isinstance(body, BaseModel):
        return f"data: {body.model_dump_json()}\n\n"  # every key, null where empty (as OpenAI's schemas)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
RETRY_AFTER_S = 5  # what a draining server tells clients (another replica, or this one restarted, by then)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# ---- logprobs -----------------------------------------------------------------------------------------------
def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[dict[int, float]],
                  k: int) -> list[TokenLogprob]:
    """The chat API's per-token logprobs (each entry: chosen token first, then the alternatives)."""
    out = []
    for tok, entry in zip(token_ids, entries):
        top = [TopLogprob(token=token_text(tokenizer, t), logprob=lp, bytes=_bytes(tokenizer, t))
               for t, lp in _top(entry, k)]
        out.append(TokenLogprob(token=token_text(tokenizer, tok), logprob=entry[tok], bytes=_bytes(tokenizer, tok),
                                top_logprobs=top))
    return out


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[dict[int, float]], k: int,
                        text_offset: int) -> CompletionLogprobs:
    """The completions API's logprobs block (``text_offset`` of the first token in the choice's text)."""
    out = CompletionLogprobs()
    offset = text_offset
    for tok, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tok)
        out.tokens.append(text)
        out.token_logprobs.append(entry[tok])
        out.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in _top(entry, k)} if k else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def vllm_prompt_logprobs(tokenizer: Any, prompt: Sequence[int], entries: Sequence[dict[int, float] | None] | None,
                         ranks: Sequence[int | None] | None,
                         k: int | None) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` body: None for the first prompt token, then ``{token id: {logprob, rank,
    decoded_token}}`` with the prompt token and its top ``k`` alternatives (ranked 1..k)."""
    if entries is None or k is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = []
    for tok, entry, rank in zip(prompt, entries, ranks or ()):
        if entry is None:
            out.append(None)
            continue
        body = {str(tok): PromptLogprob(logprob=entry[tok], rank=rank, decoded_token=token_text(tokenizer, tok))}
        for r, (t, lp) in enumerate(_top(entry, k), start=1):
            body.setdefault(str(t), PromptLogprob(logprob=lp, rank=r, decoded_token=token_text(tokenizer, t)))
        out.append(body)
    return out


def echo_logprobs(tokenizer: Any, prompt: Sequence[int], entries: Sequence[dict[int, float] | None],
                  k: int) -> CompletionLogprobs:
    """The completions API's logprobs block of an echoed prompt: the first token's logprob is null (nothing
    predicts it), as OpenAI and vLLM return it."""
    out = completion_logprobs(tokenizer, prompt[1:], entries[1:], k, len(token_text(tokenizer, prompt[0])))
    out.tokens.insert(0, token_text(tokenizer, prompt[0]))
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    return out


def _bytes(tokenizer: Any, token_id: int) -> list[int] | None:
    return None if tokenizer is None else list(tokenizer.token_bytes(token_id))
