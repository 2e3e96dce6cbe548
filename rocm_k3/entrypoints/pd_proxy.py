"""The prefill/decode proxy app: an OpenAI-compatible front (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``; streaming and not) that runs each request's prefill on a prefill instance (the request cut to one
token, asking it to publish the prompt's cache) and its generation on a decode instance, which fetches that cache.

- Pools (``pd_proxy_pools``): health-checked (``GET /health`` every ``health_interval_s``; an instance that fails it
  or refuses a connection is out until a check passes), and balanced by requests in flight.
- A prefill that fails (connection refused, timeout, 5xx) is retried on another prefill instance; when none is left
  the decode instance prefills the prompt itself (a slower answer, never a lost one). A 4xx from an instance is the
  client's error and goes back to the client with its status, as does any error a decode instance answers (4xx
  or 5xx: the instance stays in its pool). A decode instance that refuses the connection is taken out and the
  next one tried; one that times out gets a 504 (the request may still run there, so it is not re-run), one that
  dies mid-stream ends the stream with an error event.
- ``/v1/responses`` with ``previous_response_id``: the conversation lives on the decode instance that answered it,
  so the request goes there and prefills there (the proxy remembers which instance made each response id).

The prefill answer's ``kv_transfer_params`` go to the decode request, as vLLM's proxies pass them. Counters on
``/metrics``.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.concurrency import run_in_threadpool

from rocm_k3.entrypoints.pd_proxy_pools import Instance, Pools

_COMPLETIONS, _CHAT, _RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"]+)"')
_REMEMBERED_RESPONSES = 4096


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """timeout_s: per upstream request; health_interval_s / health_timeout_s: the pools' ``GET /health`` checks."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout_s: float = 600.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            urls = getattr(self, name)
            if not urls:
                raise ValueError(f"{name} needs at least one URL")
            for u in urls:
                if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {u!r} is not an http(s) URL")
        for name in ("timeout_s", "health_interval_s", "health_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")


class _Upstream(Exception):
    """An instance that did not answer as it should: a 5xx (``status`` and ``body`` kept), a refused connection
    (``refused``: the request never reached it), or a timeout / reset."""

    def __init__(self, message: str, status: int | None = None, body: bytes = b"", refused: bool = False) -> None:
        super().__init__(message)
        self.status, self.body, self.refused = status, body, refused


def _post(url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)  # noqa: S310 (the operator's own instance URLs)
    except urllib.error.HTTPError as exc:
        if exc.code >= 500:
            with exc:
                raise _Upstream(f"{url} answered {exc.code}", status=exc.code, body=exc.read()) from None
        raise
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Upstream(f"{url} failed: {reason}", refused=isinstance(reason, ConnectionRefusedError)) from None


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: one choice of one token, not streamed (nor stored), publishing the cache."""
    pbody = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    pbody.pop("stream_options", None)
    if path == _RESPONSES:
        pbody.update(max_output_tokens=1, store=False, background=False)
        return pbody
    pbody.update(max_tokens=1, n=1)
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    return pbody


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout"}[status]
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class _Router:
    """The proxy's state (pools, which decode instance made each response id, metrics) and its routing. The app's
    handlers are module functions that find it on ``request.app.state.router``: FastAPI keeps endpoint functions in
    module-level caches, so handlers closing over it would keep a stopped proxy's pools and clients alive."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pools = Pools(config.prefill_urls, config.decode_urls, config.health_interval_s, config.health_timeout_s)
        self.owners: collections.OrderedDict[str, str] = collections.OrderedDict()  # response id -> decode URL
        self.registry = registry = CollectorRegistry()
        self.requests_total = Counter("rocm_k3_pd_proxy_requests", "requests routed", ["route"], registry=registry)
        self.fallbacks = Counter("rocm_k3_pd_proxy_prefill_fallbacks",
                                 "requests whose prefill no prefill instance answered, left to the decode instance",
                                 registry=registry)
        self.retries = Counter("rocm_k3_pd_proxy_retries", "upstream calls retried on another instance", ["role"],
                               registry=registry)
        self.healthy = Gauge("rocm_k3_pd_proxy_instance_healthy", "1 while the instance is in its pool",
                             ["role", "url"], registry=registry)
        self.in_flight = Gauge("rocm_k3_pd_proxy_instance_in_flight", "requests in flight", ["role", "url"],
                               registry=registry)

    def remember(self, response_id: bytes | str, inst: Instance) -> None:
        rid = response_id.decode() if isinstance(response_id, bytes) else response_id
        self.owners[rid] = inst.url
        while len(self.owners) > _REMEMBERED_RESPONSES:
            self.owners.popitem(last=False)

    def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | Response | None:
        """The prefill answer, a client error to pass back, or None (no instance answered: prefill on decode)."""
        pools, tried = self.pools, []
        while (inst := pools.pick("prefill", tuple(tried))) is not None:
            tried.append(inst.url)
            try:
                with pools.use(inst), _post(inst.url + path, prefill_body(path, body), headers,
                                            self.config.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:  # 4xx: the request's fault, every instance would refuse it
                return Response(exc.read(), status_code=exc.code, media_type="application/json")
            except (_Upstream, OSError, http.client.HTTPException, ValueError):  # incl. a body cut off or bad
                pools.set_health(inst, False)  # out until its next passing health check
                self.retries.labels("prefill").inc()
        self.fallbacks.inc()
        return None

    def decode(self, path: str, body: dict[str, Any], headers: dict[str, str], pinned: str | None) -> Response:
        pools, tried = self.pools, []
        while True:
            inst = pools.by_url(pinned) if pinned and not tried else (
                pools.pick("decode", tuple(tried)) or pools.pick("decode", tuple(tried), healthy_only=False))
            if inst is None:
                return _error(503, f"no decode instance answered (tried {tried})")
            tried.append(inst.url)
            pools.acquire(inst)  # released when the answer (or the stream) ends
            try:
                resp = _post(inst.url + path, body, headers, self.config.timeout_s)
            except urllib.error.HTTPError as exc:
                pools.release(inst)
                return Response(exc.read(), status_code=exc.code, media_type="application/json")
            except _Upstream as exc:
                pools.release(inst)
                if exc.status is not None:  # the instance's own error answer (a failed request): the client's
                    return Response(exc.body, status_code=exc.status, media_type="application/json")
                if not exc.refused:  # timed out or reset after the request went out: it may still be running
                    return _error(504, f"decode instance {inst.url} did not answer: {exc}")
                pools.set_health(inst, False)  # never reached: out until its next passing health check
                self.retries.labels("decode").inc()
                continue
            if body.get("stream"):
                return StreamingResponse(self.relay(resp, inst, path), status_code=resp.status,
                                         media_type="text/event-stream")
            try:
                with resp:
                    data = resp.read()
            except (OSError, http.client.HTTPException) as exc:  # the instance died or stalled mid-answer
                pools.set_health(inst, False)
                return _error(502, f"decode instance {inst.url} failed mid-answer: {exc!r}")
            finally:
                pools.release(inst)
            if path == _RESPONSES and (m := _RESPONSE_ID.search(data)):
                self.remember(m.group(1), inst)
            return Response(data, status_code=resp.status, media_type="application/json")

    def relay(self, resp, inst: Instance, path: str) -> Iterator[bytes]:
        seen = path != _RESPONSES
        try:
            with resp:
                while chunk := resp.read1(65536):
                    if not seen and (m := _RESPONSE_ID.search(chunk)):
                        self.remember(m.group(1), inst)
                        seen = True
                    yield chunk
        except (OSError, http.client.HTTPException) as exc:  # the instance died or stalled mid-stream
            self.pools.set_health(inst, False)
            error = {"message": f"decode instance {inst.url} failed mid-stream: {exc!r}", "type": "BadGateway",
                     "code": 502}
            yield b"\n\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"
        finally:
            self.pools.release(inst)

    def route(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        self.requests_total.labels(path).inc()
        pinned = self.owners.get(str(body.get("previous_response_id"))) if path == _RESPONSES else None
        dbody = dict(body)
        if path != _RESPONSES or body.get("previous_response_id") is None:
            answer = self.prefill(path, body, headers)
            if isinstance(answer, Response):
                return answer
            if isinstance(answer, dict) and answer.get("kv_transfer_params"):
                dbody["kv_transfer_params"] = answer["kv_transfer_params"]
        return self.decode(path, dbody, headers, pinned)

    def forward_get(self, url: str) -> Response:
        try:
            with urllib.request.urlopen(url, timeout=self.config.timeout_s) as resp:  # noqa: S310
                return Response(resp.read(), status_code=resp.status, media_type="application/json")
        except urllib.error.HTTPError as exc:
            return Response(exc.read(), status_code=exc.code, media_type="application/json")
        except (urllib.error.URLError, OSError) as exc:
            return _error(503, f"{url} failed: {exc}")


def _router(request: Request) -> _Router:
    return request.app.state.router


async def _post_route(request: Request, path: str) -> Response:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "request body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object")
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    return await run_in_threadpool(_router(request).route, path, body, headers)


async def _completions(request: Request) -> Response:
    return await _post_route(request, _COMPLETIONS)


async def _chat(request: Request) -> Response:
    return await _post_route(request, _CHAT)


async def _responses(request: Request) -> Response:
    return await _post_route(request, _RESPONSES)


def _get_response(request: Request, response_id: str) -> Response:
    router = _router(request)
    owner = router.owners.get(response_id)
    if owner is None:
        return JSONResponse({"error": {"message": f"no response {response_id!r} passed through this proxy",
                                       "type": "NotFoundError", "param": "response_id", "code": 404}}, 404)
    return router.forward_get(f"{owner}/v1/responses/{response_id}")


def _models(request: Request) -> Response:
    router = _router(request)
    inst = router.pools.pick("decode") or router.pools.pick("decode", healthy_only=False)
    return router.forward_get(inst.url + "/v1/models")


def _health(request: Request) -> Response:
    """200 while each pool has a healthy instance or the decode pool can prefill alone; 503 without decode."""
    pools = _router(request).pools
    ok = pools.pick("decode") is not None
    return JSONResponse({"status": "ok" if ok else "unavailable",
                         "instances": [dataclasses.asdict(i) for i in pools.instances]},
                        status_code=200 if ok else 503)


def _metrics(request: Request) -> Response:
    router = _router(request)
    for inst in router.pools.instances:
        router.healthy.labels(inst.role, inst.url).set(1 if inst.healthy else 0)
        router.in_flight.labels(inst.role, inst.url).set(inst.in_flight)
    return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")


def build_proxy_app(config: ProxyConfig) -> FastAPI:
    """The app; ``app.state.pools`` is started (its health checks run) and must be stopped by the caller."""
    app = FastAPI(title="rocm-k3 pd-proxy")
    router = _Router(config)
    for path, handler in ((_COMPLETIONS, _completions), (_CHAT, _chat), (_RESPONSES, _responses)):
        app.add_api_route(path, handler, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", _get_response, methods=["GET"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.state.router = router
    app.state.pools = router.pools
    router.pools.start()
    return app
