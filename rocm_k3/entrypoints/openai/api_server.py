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
import threading
import time

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.engine.async_llm import AsyncLLM
from rocm_k3.engine.assembly import AssembledEngine, assemble_engine
from rocm_k3.entrypoints.image_fetch import FetchLimits, ImageFetcher
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
from rocm_k3.entrypoints.openai.routes_responses import install_responses_routes
from rocm_k3.entrypoints.openai.serving_chat import prepare_chat
from rocm_k3.entrypoints.openai.serving_common import (
    RETRY_AFTER_S,
    ServedModel,
    fetch_remote_images,
    read_body,
    unless_disconnected,
)
from rocm_k3.entrypoints.openai.serving_completion import prepare_completion
from rocm_k3.formats import thinking_options
from rocm_k3.formats.chat_base import parse_effort_budgets

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
        if served.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
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
        return await _answer(request, served, ChatCompletionRequest, prepare_chat, fetch_images=True)

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

    install_responses_routes(app, served, auth)
    return app


async def _answer(request: Request, served: ServedModel, model, prepare, fetch_images: bool = False) -> Response:
    """Read, check and run one completions / chat request: SSE when it streams, else one JSON body. A chat's
    remote images are fetched first, in the image fetch pool (never in the threads that render requests)."""
    body = await read_body(request, model, served.max_request_bytes)
    fetched = (await fetch_remote_images(served, body.messages),) if fetch_images else ()
    run = await asyncio.to_thread(prepare, served, body, *fetched)  # rendering and tokenizing: off the event loop
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
    assembled.frontend.effort_budgets = parse_effort_budgets(server_args.reasoning_effort_budgets)
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
    assembled = assemble_engine(engine_args)
    engine = AsyncLLM(assembled.core)
    try:
        served = served_model(engine, assembled, server_args)
        app = build_app(served)
        log.info("serving %s as %s on http://%s:%d (max_model_len %d)", assembled.path, served.names, server_args.host,
                    server_args.port, served.max_model_len)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.uvicorn_log_level, timeout_graceful_shutdown=5)
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
            log.warning("shutdown timeout: ending %d running requests with an error", left)
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
