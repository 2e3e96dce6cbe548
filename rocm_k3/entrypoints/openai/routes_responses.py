"""The ``/v1/responses`` routes: create (JSON, server-sent events, or background), retrieve, delete, cancel."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rocm_k3.entrypoints.openai.errors import APIError
from rocm_k3.entrypoints.openai.protocol_responses import ResponsesRequest
from rocm_k3.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from rocm_k3.entrypoints.openai.serving_common import (
    ServedModel,
    fetch_remote_images,
    logged_stream,
    read_body,
    unless_disconnected,
)
from rocm_k3.entrypoints.openai.serving_responses import conversation, prepare_responses

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def install_responses_routes(app: FastAPI, store_size: int, auth: list) -> ResponseStore:
    """The routes on ``app``, with a store of ``store_size`` responses in ``app.state.responses``. Like
    api_server's, the handlers reach the served model and the store through ``request.app.state`` (FastAPI keeps
    endpoint functions alive in its caches: a closure over them would outlive the server)."""
    store = ResponseStore(store_size)
    app.state.responses = store

    @app.post("/v1/responses", dependencies=auth)
    async def create(request: Request) -> Response:
        served, store = _state(request)
        body = await read_body(request, ResponsesRequest, served.max_request_bytes)
        fetched = await fetch_remote_images(served, conversation(store, body))  # in the image fetch pool
        run = await asyncio.to_thread(prepare_responses, served, store, body, fetched)
        if body.background:
            return JSONResponse(run.start_background())
        if body.stream:
            return StreamingResponse(logged_stream(await run.stream(), request.url.path),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await unless_disconnected(request, run.respond()))

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def retrieve(request: Request, response_id: str) -> Response:
        return JSONResponse(_stored(_state(request)[1], response_id).body)

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def delete(request: Request, response_id: str) -> Response:
        store = _state(request)[1]
        item = _stored(store, response_id)
        if item.task is not None:
            item.task.cancel()
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel", dependencies=auth)
    async def cancel(request: Request, response_id: str) -> Response:
        item = _stored(_state(request)[1], response_id)
        if not item.body.get("background"):
            raise APIError(400, f"response {response_id!r} was not created with background=true; only background "
                                "responses can be cancelled", param="response_id")
        task = item.task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(item.body)

    return store


def _state(request: Request) -> tuple[ServedModel, ResponseStore]:
    """(served model, response store) of the app answering ``request``."""
    return request.app.state.served, request.app.state.responses


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    item = store.get(response_id)
    if item is None:
        raise APIError(404, f"no stored response {response_id!r}", param="response_id")
    return item
