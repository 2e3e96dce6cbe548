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
    read_body,
    unless_disconnected,
)
from rocm_k3.entrypoints.openai.serving_responses import conversation, prepare_responses

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def install_responses_routes(app: FastAPI, served: ServedModel, auth: list) -> ResponseStore:
    store = ResponseStore(served.responses_store_size)
    app.state.responses = store

    def stored(response_id: str) -> StoredResponse:
        item = store.get(response_id)
        if item is None:
            raise APIError(404, f"no stored response {response_id!r}", param="response_id")
        return item

    @app.post("/v1/responses", dependencies=auth)
    async def create(request: Request) -> Response:
        body = await read_body(request, ResponsesRequest, served.max_request_bytes)
        fetched = await fetch_remote_images(served, conversation(store, body))  # in the image fetch pool
        run = await asyncio.to_thread(prepare_responses, served, store, body, fetched)
        if body.background:
            return JSONResponse(run.start_background())
        if body.stream:
            return StreamingResponse(await run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await unless_disconnected(request, run.respond()))

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def retrieve(response_id: str) -> Response:
        return JSONResponse(stored(response_id).body)

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def delete(response_id: str) -> Response:
        item = stored(response_id)
        if item.task is not None:
            item.task.cancel()
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel", dependencies=auth)
    async def cancel(response_id: str) -> Response:
        item = stored(response_id)
        if not item.body.get("background"):
            raise APIError(400, f"response {response_id!r} was not created with background=true; only background "
                                "responses can be cancelled", param="response_id")
        task = item.task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(item.body)

    return store
