"""pd-proxy's pools against scripted upstream instances (tiny FastAPI apps on 127.0.0.1, no model): health checks
take an instance out and put it back, picks balance by requests in flight, a failed prefill is retried on another
prefill instance, and upstream client errors come back with their status."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.pd_fixtures import running_proxy, wait_for
from tests.server_fixtures import start_app


class FakeInstance:
    """An instance that logs each request body, answers /health with ``health_status``, prefills (a
    ``do_remote_decode`` request) by naming itself in ``kv_transfer_params``, and decodes with one fixed answer;
    ``status`` makes it fail every request with that code; ``hold`` (an Event) parks decodes until it is set."""

    def __init__(self, name: str) -> None:
        self.name, self.bodies, self.health_status, self.status, self.hold = name, [], 200, 200, None
        app = FastAPI()

        @app.get("/health")
        def health():
            return JSONResponse({}, status_code=self.health_status)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            if self.status != 200:
                return JSONResponse({"error": {"message": f"{self.name} says no", "code": self.status}},
                                    status_code=self.status)
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                return {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_transfer_id": self.name}}
            if self.hold is not None:
                while not self.hold.is_set():  # an async handler: poll, so the server keeps answering
                    await _sleep(0.01)
            return {"choices": [{"text": f"from {self.name}"}],
                    "got": body.get("kv_transfer_params")}

        @app.post("/v1/responses")
        async def responses(request: Request):
            body = await request.json()
            self.bodies.append(body)
            return {"id": f"resp_{self.name}_{len(self.bodies)}", "object": "response", "output": []}

        self.server = start_app(app)
        self.url = self.server.base_url


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


@contextlib.contextmanager
def instances(*names: str):
    fakes = [FakeInstance(n) for n in names]
    try:
        yield fakes
    finally:
        for f in fakes:
            if f.hold is not None:
                f.hold.set()
            f.server.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _complete(proxy) -> tuple[int, dict]:
    return _post(proxy.url("/v1/completions"), {"prompt": "hi", "max_tokens": 4})


def test_unhealthy_instance_is_taken_out_and_put_back():
    with instances("p1", "p2", "d") as (p1, p2, d), \
            running_proxy((p1.url, p2.url), d.url, health_interval_s=0.1) as proxy:
        p1.health_status = 503
        assert wait_for(lambda: not proxy_health(proxy)[p1.url])
        for _ in range(4):
            assert _complete(proxy)[0] == 200
        assert len(p1.bodies) == 0 and len(p2.bodies) == 4  # every prefill went to the healthy instance
        p1.health_status = 200
        assert wait_for(lambda: proxy_health(proxy)[p1.url])
        for _ in range(4):
            assert _complete(proxy)[0] == 200
        assert len(p1.bodies) == 2 and len(p2.bodies) == 6  # back in the pool: turns again


def proxy_health(proxy) -> dict[str, bool]:
    with urllib.request.urlopen(proxy.url("/health"), timeout=10) as resp:
        return {i["url"]: i["healthy"] for i in json.loads(resp.read())["instances"]}


def test_decode_picks_balance_by_requests_in_flight():
    with instances("p", "d1", "d2") as (p, d1, d2), running_proxy(p.url, (d1.url, d2.url)) as proxy:
        d1.hold = threading.Event()
        d2.hold = threading.Event()
        parked = threading.Thread(target=_complete, args=(proxy,), daemon=True)
        parked.start()  # one decode parked on one instance ...
        assert wait_for(lambda: len(d1.bodies) + len(d2.bodies) == 1)
        busy, idle = (d1, d2) if d1.bodies else (d2, d1)
        idle.hold = None
        for _ in range(3):  # ... so the next ones all go to the other instance
            status, answer = _complete(proxy)
            assert status == 200 and answer["choices"][0]["text"] == f"from {idle.name}"
        assert len(busy.bodies) == 1 and len(idle.bodies) == 3
        busy.hold.set()
        parked.join(10)


def test_failed_prefill_is_retried_on_another_instance_then_left_to_decode():
    with instances("p1", "p2", "d") as (p1, p2, d), \
            running_proxy((p1.url, p2.url), d.url, health_interval_s=60) as proxy:
        p1.status = 500
        for _ in range(2):
            status, answer = _complete(proxy)
            assert status == 200 and answer["got"] == {"remote_transfer_id": "p2"}  # p2's cache, not p1's
        assert len(p1.bodies) == 1  # tried once, then out of the pool until a health check passes
        metrics = urllib.request.urlopen(proxy.url("/metrics"), timeout=10).read().decode()
        assert 'rocm_k3_pd_proxy_retries_total{role="prefill"} 1.0' in metrics
        p2.status = 503
        status, answer = _complete(proxy)
        assert status == 200 and answer["got"] is None  # no prefill instance left: decode prefills itself
        metrics = urllib.request.urlopen(proxy.url("/metrics"), timeout=10).read().decode()
        assert "rocm_k3_pd_proxy_prefill_fallbacks_total 1.0" in metrics


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_upstream_client_errors_come_back_with_their_status(side):
    with instances("p", "d") as (p, d), running_proxy(p.url, d.url) as proxy:
        (p if side == "prefill" else d).status = 422
        status, answer = _complete(proxy)
        assert status == 422 and answer["error"]["message"] == f"{side[0]} says no"
        assert len(d.bodies) == (0 if side == "prefill" else 1)  # a refused prefill is not sent on to decode
        status, answer = _post(proxy.url("/v1/completions"), [1, 2])
        assert status == 400 and "JSON object" in answer["error"]["message"]


def test_a_decode_error_answer_comes_back_once_and_keeps_the_instance_in_its_pool():
    """A 5xx a decode instance answers is that request's failure: the client gets it as it is, the request is not
    re-run on the other decode instance, and neither instance leaves its pool."""
    with instances("p", "d1", "d2") as (p, d1, d2), running_proxy(p.url, (d1.url, d2.url),
                                                                  health_interval_s=60) as proxy:
        d1.status = d2.status = 500
        status, answer = _complete(proxy)
        assert status == 500 and answer["error"]["message"] in ("d1 says no", "d2 says no")
        assert len(d1.bodies) + len(d2.bodies) == 1
        d1.status = d2.status = 200
        status, answer = _complete(proxy)
        assert status == 200 and answer["choices"][0]["text"].startswith("from d")
        metrics = urllib.request.urlopen(proxy.url("/metrics"), timeout=10).read().decode()
        assert 'rocm_k3_pd_proxy_instance_healthy{role="decode",url="%s"} 1.0' % d1.url in metrics
        assert 'rocm_k3_pd_proxy_instance_healthy{role="decode",url="%s"} 1.0' % d2.url in metrics


def test_no_decode_instance_answering_is_a_503():
    with instances("p") as (p,):
        with instances("d") as (d,):
            dead = d.url
        with running_proxy(p.url, dead, health_interval_s=60) as proxy:
            status, answer = _complete(proxy)
    assert status == 503 and "no decode instance answered" in answer["error"]["message"]


def test_responses_follow_up_goes_to_the_decode_instance_holding_the_conversation():
    with instances("p", "d1", "d2") as (p, d1, d2), running_proxy(p.url, (d1.url, d2.url)) as proxy:
        status, first = _post(proxy.url("/v1/responses"), {"input": "hi"})
        assert status == 200
        owner = d1 if first["id"].startswith("resp_d1") else d2
        assert p.bodies[-1]["max_output_tokens"] == 1 and p.bodies[-1]["store"] is False
        for _ in range(3):  # round-robin would alternate; the conversation pins them to its owner
            status, answer = _post(proxy.url("/v1/responses"), {"input": "more", "previous_response_id": first["id"]})
            assert status == 200 and answer["id"].startswith(f"resp_{owner.name}")
        assert len(p.bodies) == 1  # the follow-ups were prefilled on their decode instance
        status, answer = _post(proxy.url("/v1/responses"), {"input": "x", "previous_response_id": "resp_nope"})
        assert status == 200  # an id the proxy never saw: any decode instance answers (its own 404 if it has none)
