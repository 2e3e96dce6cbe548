"""A stopped in-process server lets its engine go: nothing the app registered (FastAPI keeps endpoint and
dependency functions in module-level caches) keeps the engine core, its weights and its caches alive."""

from __future__ import annotations

import gc
import json
import urllib.request
import weakref

from rocm_k3.args import EngineArgs, ServerArgs
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server


def _post(srv, route: str, body: dict) -> dict:
    req = urllib.request.Request(srv.url(route), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_a_stopped_server_releases_its_engine() -> None:
    cores = []
    for _ in range(2):
        args = ServerArgs(port=0, api_key="k", uvicorn_log_level="warning")
        with running_server(EngineArgs(dtype="float32", max_model_len=1024), args) as srv:
            # every kind of route ran once: completions, chat, responses (stored), models, tokenize, health
            assert _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})["choices"]
            assert _post(srv, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})["choices"]
            rid = _post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 2})["id"]
            got = urllib.request.Request(srv.url(f"/v1/responses/{rid}"), headers={"Authorization": "Bearer k"})
            with urllib.request.urlopen(got, timeout=60) as r:
                assert json.loads(r.read())["id"] == rid
            assert _post(srv, "/tokenize", {"prompt": "hi"})["count"] > 0
            with urllib.request.urlopen(srv.url("/health"), timeout=60) as r:
                assert r.status == 200
            cores.append(weakref.ref(srv.engine.core))
        del srv
        gc.collect()
    alive = [i for i, ref in enumerate(cores) if ref() is not None]
    assert not alive, f"the engine cores of stopped servers {alive} are still referenced"


def test_a_stopped_pd_proxy_releases_its_router() -> None:
    """The same for ``pd-proxy``: its routes find their state on ``app.state.router``; after every kind of route ran
    (POSTs answered 503: the decode URL refuses connections; a missing response id 404; health, metrics, models),
    a stopped proxy's router, pools and metrics registry go."""
    import urllib.error

    from tests.pd_fixtures import free_port, running_proxy

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    routers = []
    for _ in range(2):
        with running_proxy(dead, dead, health_interval_s=60) as srv:
            for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
                req = urllib.request.Request(srv.url(route), data=b'{"prompt": "hi"}',
                                             headers={"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=60)
                    raise AssertionError(f"{route} answered although no decode instance runs")
                except urllib.error.HTTPError as exc:
                    assert exc.code == 503, (route, exc.code)
            for route, status in (("/v1/responses/resp_x", 404), ("/health", 503), ("/metrics", 200),
                                  ("/v1/models", 503)):
                try:
                    with urllib.request.urlopen(srv.url(route), timeout=60) as r:
                        assert r.status == status, (route, r.status)
                except urllib.error.HTTPError as exc:
                    assert exc.code == status, (route, exc.code)
            routers.append(weakref.ref(srv._server.config.app.state.router))
        del srv
        gc.collect()
    alive = [i for i, ref in enumerate(routers) if ref() is not None]
    assert not alive, f"the routers of stopped proxies {alive} are still referenced"
