"""The OpenAI-compatible HTTP server: the FastAPI app over one :class:`~rocm_k3.engine.async_llm.AsyncLLM`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers
with server-sent events ending in ``data: [DONE]``), ``POST /tokenize``, ``POST /detokenize``, ``GET /health``
(200, or 503 once the engine failed), ``GET /metrics`` (Prometheus text). With an API key, every route except
``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``. Errors are OpenAI error objects
(``errors.py``). A client that disconnects aborts its requests (streaming: the response is cancelled; otherwise
a watcher on the connection cancels the handler).

:func:`build_app` makes the app (tests drive it with uvicorn on a free port); :func:`serve` is ``rocm-k3 serve``:
assemble the engine (:func:`~rocm_k3.engine.assembly.assemble_engine`), then run uvicorn until Ctrl-C, and shut the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.engine.async_llm import AsyncLLM
from rocm_k3.engine.assembly import AssembledEngine, assemble_engine
from rocm_k3.entrypoints.openai.errors import APIError, bad_request, install_error_handlers
from rocm_k3.entrypoints.openai.metrics import ServerMetrics
from rocm_k3.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from rocm_k3.entrypoints.openai.serving_chat import prepare_chat
from rocm_k3.entrypoints.openai.serving_common import ServedModel, read_body, unless_disconnected
from rocm_k3.entrypoints.openai.serving_completion import prepare_completion
from rocm_k3.formats import thinking_options

log = logging.getLogger("rocm_k3.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(served: ServedModel) -> FastAPI:
    """The app serving ``served`` (the caller owns the engine and shuts it down)."""
    app = FastAPI(title="rocm-k3", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    install_error_handlers(app)

    async def check_key(request: Request) -> None:
        if served.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), served.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    auth = [Depends(check_key)]

    @app.get("/health")
    async def health() -> Response:
        if served.engine.is_dead:
            return JSONResponse({"status": "engine failed", "reason": served.engine.dead_reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        root = str(served.frontend.path)
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=served.max_model_len) for n in served.names])

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await _answer(request, served, CompletionRequest, prepare_completion)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, served, ChatCompletionRequest, prepare_chat)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        req = await read_body(request, TokenizeRequest, served.max_request_bytes)
        served.check_model(req.model)
        ids = _tokenize(served, req)
        body: dict = {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [served.tokenizer.decode([t]) for t in ids]
        return JSONResponse(body)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        req = await read_body(request, DetokenizeRequest, served.max_request_bytes)
        served.check_model(req.model)
        if served.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        bad = [t for t in req.tokens if not 0 <= t < served.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:8]} outside the vocabulary [0, {served.tokenizer.vocab_size})",
                           param="tokens")
        return JSONResponse({"prompt": served.tokenizer.decode(req.tokens)})

    return app


async def _answer(request: Request, served: ServedModel, model, prepare) -> Response:
    """Read, check and run one completions / chat request: SSE when it streams, else one JSON body."""
    body = await read_body(request, model, served.max_request_bytes)
    run = await asyncio.to_thread(prepare, served, body)  # rendering and tokenizing: off the event loop
    if run.req.stream:
        return StreamingResponse(await run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse((await unless_disconnected(request, run.respond())).model_dump(exclude_none=True))


def _tokenize(served: ServedModel, req: TokenizeRequest) -> list[int]:
    if served.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "tokenize: expected exactly one of 'prompt' and 'messages'", param="prompt")
    if req.prompt is not None:
        return served.tokenizer.encode(req.prompt)
    renderer = served.frontend.renderer
    if renderer is None:
        raise APIError(400, "messages: this model has no chat format", param="messages")
    try:
        options = thinking_options(req.chat_template_kwargs, None)
        return list(renderer.render(req.messages, tools=req.tools, thinking=options.thinking,
                                    thinking_effort=options.effort,
                                    add_generation_prompt=req.add_generation_prompt).token_ids)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc, "messages") from None


def served_model(engine: AsyncLLM, assembled: AssembledEngine, server_args: ServerArgs) -> ServedModel:
    """The handlers' view of an assembled engine (``engine`` drives ``assembled.core``)."""
    names = server_args.served_model_name or [assembled.args.model or assembled.path.name]
    return ServedModel(engine=engine, frontend=assembled.frontend, names=list(names),
                       max_model_len=assembled.max_model_len, vocab_size=assembled.core.vocab_size,
                       metrics=ServerMetrics(engine), api_key=server_args.api_key,
                       enable_auto_tool_choice=server_args.enable_auto_tool_choice,
                       max_request_bytes=server_args.max_request_bytes, multimodal=assembled.multimodal,
                       allow_remote_images=server_args.allow_remote_images,
                       max_image_bytes=server_args.max_image_bytes)


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """``rocm-k3 serve``: load the model, serve until interrupted; returns the exit status."""
    import uvicorn

    assembled = assemble_engine(engine_args)
    engine = AsyncLLM(assembled.core)
    try:
        served = served_model(engine, assembled, server_args)
        app = build_app(served)
        log.info("serving %s as %s on http://%s:%d (max_model_len %d)", assembled.path, served.names, server_args.host,
                    server_args.port, served.max_model_len)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.uvicorn_log_level, timeout_graceful_shutdown=5)
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(config).run()
    finally:
        engine.shutdown()
        assembled.shutdown()  # the worker processes of a parallel run
    return 0
