"""The OpenAI-compatible HTTP server: the FastAPI app over one :class:`~rocm_k3.engine.async_llm.AsyncLLM`.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers
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
import logging.config
import threading
import time

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rocm_k3.args import EngineArgs, ServerArgs, read_chat_template_arg
from rocm_k3.engine.async_llm import AsyncLLM
from rocm_k3.engine.assembly import AssembledEngine, assemble_engine
from rocm_k3.entrypoints.image_fetch import FetchLimits, ImageFetcher
from rocm_k3.entrypoints.openai.errors import APIError, install_error_handlers
from rocm_k3.entrypoints.openai.metrics import ServerMetrics
from rocm_k3.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from rocm_k3.entrypoints.openai.routes_responses import install_responses_routes
from rocm_k3.entrypoints.openai.serving_chat import chat_prompt, prepare_chat
from rocm_k3.entrypoints.openai.request_ids import RequestIdMiddleware, serve_log_config
from rocm_k3.entrypoints.openai.serving_common import (
    RETRY_AFTER_S,
    ServedModel,
    fetch_remote_images,
    logged_stream,
    read_body,
    unless_disconnected,
)
from rocm_k3.entrypoints.openai.serving_completion import prepare_completion
from rocm_k3.formats.chat_base import parse_effort_budgets

log = logging.getLogger("rocm_k3.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _App(FastAPI):
    """FastAPI with :class:`RequestIdMiddleware` outside every other layer, so that even a 500 answered by the
    server-error layer carries ``x-request-id`` and its log line the id."""

    def build_middleware_stack(self):
        return RequestIdMiddleware(super().build_middleware_stack())


def build_app(served: ServedModel) -> FastAPI:
    """The app serving ``served`` (the caller owns the engine and shuts it down).

    The handlers find the served model through ``request.app.state.served`` and never hold it themselves: FastAPI
    keeps every endpoint and dependency function it has seen in module-level caches, so a handler that closed over
    ``served`` would keep the engine (weights, caches) alive after its server stopped, for as long as the process
    lives (an embedding process that builds and stops servers, or a test session).
    """
    app = _App(title="rocm-k3", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    install_error_handlers(app)

    async def check_key(request: Request) -> None:
        key = _served(request).api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    auth = [Depends(check_key)]

    @app.get("/health")
    async def health(request: Request) -> Response:
        sm = _served(request)
        if sm.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        if sm.engine.is_dead:
            return JSONResponse({"status": "engine failed", "reason": sm.engine.dead_reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_served(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models(request: Request) -> ModelList:
        sm = _served(request)
        return ModelList(data=[_card(sm, n) for n in sm.names])

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(request: Request, model_id: str) -> ModelCard:
        sm = _served(request)
        return _card(sm, sm.check_model(model_id))  # 404 naming the model when unknown

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await _answer(request, _served(request), CompletionRequest, prepare_completion)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, _served(request), ChatCompletionRequest, prepare_chat, fetch_images=True)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        sm = _served(request)
        req = await read_body(request, TokenizeRequest, sm.max_request_bytes)
        sm.check_model(req.model)
        remote = await fetch_remote_images(sm, req.messages) if req.messages is not None else None
        ids = await asyncio.to_thread(_tokenize, sm, req, remote)
        body: dict = {"count": len(ids), "max_model_len": sm.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [sm.tokenizer.decode([t]) for t in ids]
        return JSONResponse(body)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        sm = _served(request)
        req = await read_body(request, DetokenizeRequest, sm.max_request_bytes)
        sm.check_model(req.model)
        if sm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        bad = [t for t in req.tokens if not 0 <= t < sm.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:8]} outside the vocabulary [0, {sm.tokenizer.vocab_size})",
                           param="tokens")
        return JSONResponse({"prompt": sm.tokenizer.decode(req.tokens)})

    install_responses_routes(app, served.responses_store_size, auth)
    return app


def _served(request: Request) -> ServedModel:
    """The served model of the app answering ``request`` (see :func:`build_app`)."""
    return request.app.state.served


def _card(served: ServedModel, name: str) -> ModelCard:
    return ModelCard(id=name, root=str(served.frontend.path), max_model_len=served.max_model_len)


async def _answer(request: Request, served: ServedModel, model, prepare, fetch_images: bool = False) -> Response:
    """Read, check and run one completions / chat request: SSE when it streams, else one JSON body. A chat's
    remote images are fetched first, in the image fetch pool (never in the threads that render requests)."""
    body = await read_body(request, model, served.max_request_bytes)
    fetched = (await fetch_remote_images(served, body.messages),) if fetch_images else ()
    run = await asyncio.to_thread(prepare, served, body, *fetched)  # rendering and tokenizing: off the event loop
    if run.req.stream:
        return StreamingResponse(logged_stream(await run.stream(), request.url.path), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return JSONResponse((await unless_disconnected(request, run.respond())).model_dump())  # null keys kept


def _tokenize(served: ServedModel, req: TokenizeRequest, remote: dict[str, bytes] | None) -> list[int]:
    if served.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "tokenize: expected exactly one of 'prompt' and 'messages'", param="prompt")
    if req.prompt is not None:
        return served.tokenizer.encode(req.prompt)
    return chat_prompt(served, req, remote)[1]  # the chat API's own rendering: the very ids generation runs


def served_model(engine: AsyncLLM, assembled: AssembledEngine, server_args: ServerArgs) -> ServedModel:
    """The handlers' view of an assembled engine (``engine`` drives ``assembled.core``)."""
    names = server_args.served_model_name or [assembled.args.model or assembled.path.name]
    assembled.frontend.effort_budgets = parse_effort_budgets(server_args.reasoning_effort_budgets)
    if server_args.chat_template is not None:
        assembled.frontend.chat_template = read_chat_template_arg(server_args.chat_template)
        if assembled.frontend.renderer is None:  # compiles it now: a bad template fails the start, naming it
            raise ValueError("--chat-template: this model has no tokenizer to render chats with")
    return ServedModel(engine=engine, frontend=assembled.frontend, names=list(names),
                       max_model_len=assembled.max_model_len, vocab_size=assembled.core.vocab_size,
                       metrics=ServerMetrics(engine), api_key=server_args.api_key,
                       enable_auto_tool_choice=server_args.enable_auto_tool_choice,
                       max_request_bytes=server_args.max_request_bytes, multimodal=assembled.multimodal,
                       image_fetcher=image_fetcher(server_args),
                       max_image_bytes=server_args.max_image_bytes,
                       responses_store_size=server_args.responses_store_size)


def image_fetcher(server_args: ServerArgs) -> ImageFetcher | None:
    """The pool that fetches remote images (``--allow-remote-images``), else None (http(s) images refused)."""
    if not server_args.allow_remote_images:
        return None
    limits = FetchLimits(timeout_s=server_args.image_fetch_timeout, max_bytes=server_args.max_image_bytes,
                         max_redirects=server_args.image_fetch_max_redirects,
                         allow_private=server_args.allow_private_image_hosts)
    return ImageFetcher(server_args.image_fetch_workers, limits)


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """``rocm-k3 serve``: load the model, serve until interrupted; returns the exit status."""
    uvicorn_level = server_args.resolved_uvicorn_log_level
    log_config = serve_log_config(server_args.resolved_log_level, uvicorn_level)
    logging.config.dictConfig(log_config)  # from the start: the loading's lines look like the serving's
    assembled = assemble_engine(engine_args)
    engine = AsyncLLM(assembled.core)
    try:
        served = served_model(engine, assembled, server_args)
        app = build_app(served)
        log.info("serving %s as %s on http://%s:%d (max_model_len %d)", assembled.path, served.names, server_args.host,
                    server_args.port, served.max_model_len)
        # lifespan off: the app has no startup / shutdown hooks, and a cancelled lifespan task printed a traceback
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=uvicorn_level,
                                log_config=log_config, timeout_graceful_shutdown=5, lifespan="off")
        server = DrainingServer(config, served, server_args.shutdown_timeout)
        watchdog = EngineWatchdog(engine, server)
        watchdog.start()
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        watchdog.stop()
    finally:
        engine.shutdown()
        assembled.shutdown()  # the worker processes of a parallel run
    if engine.failed:
        log.error("exiting with status 1: %s", engine.dead_reason)
        return 1  # an orchestrator restarts a server whose engine failed (vLLM's behaviour); never a zombie
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful drain on SIGTERM / SIGINT (what Kubernetes and vLLM users expect).

    First signal: ``/health`` and new requests answer 503 with ``Retry-After``; running requests have up to
    ``shutdown_timeout`` seconds to finish; then the engine is shut down, so the rest end with an error event
    and ``data: [DONE]``, and the server stops (exit status 0). A second signal exits at once."""

    def __init__(self, config, served: ServedModel, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._served, self._timeout = served, shutdown_timeout
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:  # uvicorn's signal handler (main thread)
        if self._drain is not None:
            log.warning("second signal: exiting now")
            self.force_exit = self.should_exit = True
            return
        log.info("signal %d: draining (%d requests running, up to %.0f s), new requests get 503", sig,
                 self._served.engine.num_streams, self._timeout)
        self._served.draining = True
        self._drain = threading.Thread(target=self._drain_then_exit, name="rocm-k3-drain", daemon=True)
        self._drain.start()

    def _drain_then_exit(self) -> None:
        engine = self._served.engine
        deadline = time.monotonic() + self._timeout
        while engine.num_streams and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        left = engine.num_streams
        if left:
            log.warning("%s: ending %d running requests with an error",
                        "second signal" if self.force_exit else "shutdown timeout", left)
        engine.shutdown()  # the rest get EngineDeadError -> an error event and [DONE]; their cache is freed
        self.should_exit = True


class EngineWatchdog:
    """Ends the HTTP server once the engine has failed (a worker rank died or hung, a step raised): ``/health``
    answers 503 from the failure on, in-flight requests have their error, and :func:`serve` exits non-zero."""

    def __init__(self, engine: AsyncLLM, server, poll_s: float = 0.5) -> None:
        self._engine, self._server, self._poll_s = engine, server, poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rocm-k3-engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)

    def _watch(self) -> None:
        while not self._done.wait(self._poll_s):
            if self._engine.failed:
                log.error("the engine failed (%s): stopping the server", self._engine.dead_reason)
                self._server.should_exit = True
                return
