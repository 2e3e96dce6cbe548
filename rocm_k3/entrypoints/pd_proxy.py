"""The prefill/decode proxy app: an OpenAI-compatible front that runs each request's prefill on a prefill instance
(the request with ``max_tokens=1``) and its generation on a decode instance; if the prefill instance fails, the
decode instance prefills the prompt itself (a slower answer, never a lost one).

The prefill answer's ``kv_transfer_params`` (when the instance returns them) are passed on to the decode request, as
vLLM's proxies do. Counters on ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.concurrency import run_in_threadpool

_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            urls = getattr(self, name)
            if not urls:
                raise ValueError(f"{name} needs at least one URL")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {u!r} is not an http(s) URL")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class _Pools:
    """Round-robin over each pool (load balancing by outstanding requests is not built yet)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._next = {"prefill": 0, "decode": 0}

    def pick(self, role: str) -> str:
        urls = self.config.prefill_urls if role == "prefill" else self.config.decode_urls
        i = self._next[role]
        self._next[role] = (i + 1) % len(urls)
        return urls[i].rstrip("/")


def _post(url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    return urllib.request.urlopen(req, timeout=timeout_s)  # noqa: S310 (the operator's own instance URLs)


def build_proxy_app(config: ProxyConfig) -> FastAPI:
    app = FastAPI(title="rocm-k3 pd-proxy")
    pools = _Pools(config)
    registry = CollectorRegistry()
    requests_total = Counter("rocm_k3_pd_proxy_requests", "requests routed", ["route"], registry=registry)
    fallbacks = Counter("rocm_k3_pd_proxy_prefill_fallbacks",
                        "prefills that failed and were left to the decode instance", registry=registry)

    def prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        # one choice, one token; the prefill instance publishes the prompt's cache and answers where it is
        pbody = {**body, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}}
        pbody.pop("stream_options", None)
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        try:
            with _post(pools.pick("prefill") + path, pbody, headers, config.timeout_s) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            fallbacks.inc()
            return None

    def route(path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        requests_total.labels(path).inc()
        answer = prefill(path, body, headers)
        dbody = dict(body)
        if answer and answer.get("kv_transfer_params"):
            dbody["kv_transfer_params"] = answer["kv_transfer_params"]
        url = pools.pick("decode") + path
        try:
            resp = _post(url, dbody, headers, config.timeout_s)
        except urllib.error.HTTPError as exc:
            return Response(exc.read(), status_code=exc.code, media_type="application/json")
        except (urllib.error.URLError, OSError) as exc:
            return JSONResponse({"error": {"message": f"decode instance {url} failed: {exc}",
                                           "type": "ServiceUnavailable", "code": 503}}, status_code=503)
        if body.get("stream"):
            def chunks() -> Iterator[bytes]:
                with resp:
                    while chunk := resp.read1(65536):
                        yield chunk
            return StreamingResponse(chunks(), media_type="text/event-stream")
        with resp:
            return Response(resp.read(), status_code=resp.status, media_type="application/json")

    def make_handler(path: str):
        async def handler(request: Request) -> Response:
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse({"error": {"message": "request body is not valid JSON", "code": 400}}, 400)
            if not isinstance(body, dict):
                return JSONResponse({"error": {"message": "request body must be a JSON object", "code": 400}}, 400)
            headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
            return await run_in_threadpool(route, path, body, headers)
        return handler

    for path in _ROUTES:
        app.add_api_route(path, make_handler(path), methods=["POST"])

    @app.get("/v1/models")
    def models() -> Response:
        url = pools.pick("decode") + "/v1/models"
        try:
            with urllib.request.urlopen(url, timeout=config.timeout_s) as resp:  # noqa: S310
                return Response(resp.read(), status_code=resp.status, media_type="application/json")
        except urllib.error.HTTPError as exc:
            return Response(exc.read(), status_code=exc.code, media_type="application/json")
        except (urllib.error.URLError, OSError) as exc:
            return JSONResponse({"error": {"message": f"decode instance {url} failed: {exc}", "code": 503}}, 503)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return app
