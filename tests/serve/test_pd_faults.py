"""Prefill/decode disaggregation under faults, with real server processes on 127.0.0.1 (the embedded model):

- the decode server SIGKILLed while requests stream through the proxy leaves the prefill server with every KV
  block and KDA slot free (its ``/metrics``) and its published caches gone within their ttl, and still serving;
- the prefill server SIGKILLed makes the proxy take it out of its pool and fall back to decode-side prefill: the
  answers equal the decode server's own.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import threading
import urllib.error
import urllib.request

import pytest

from rocm_k3.args import EngineArgs
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.pd_fixtures import chat, complete, free_port, running_proxy, wait_for
from tests.server_fixtures import running_server, spawn_serve

ENGINE = dict(dtype="float32", max_model_len=512)
FLAGS = ("--dtype", "float32", "--max-model-len", "512")
PROMPTS = ("The capital of France is", "Once upon a time there was a")


def _config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "SocketConnector", "kv_role": role, **extra})


def _metrics(base_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(rocm_k3_\w+) (\S+)$", text, re.M)}


def _all_free(base_url: str) -> bool:
    m = _metrics(base_url)
    return m["rocm_k3_kv_blocks_free"] == m["rocm_k3_kv_blocks_total"] and \
        m["rocm_k3_kda_slots_free"] == m["rocm_k3_kda_slots_total"] and m["rocm_k3_requests_running"] == 0 and \
        m["rocm_k3_requests_waiting"] == 0


@contextlib.contextmanager
def _process(workdir, *flags: str):
    """A ``rocm-k3 serve`` process; yields (process, base URL); killed at the end if still alive."""
    proc, port, _ = spawn_serve(workdir, *flags)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _stream_until_error(proxy_url: str, model: str, started: threading.Event, outcomes: list[str]) -> None:
    """Long greedy streams through the proxy, one after another, until one fails (the decode server died)."""
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    for _ in range(20):
        req = urllib.request.Request(proxy_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                while chunk := resp.read1(4096):
                    if b"data:" in chunk:
                        started.set()
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            outcomes.append(type(exc).__name__)
            return
        if resp.status != 200:
            outcomes.append(str(resp.status))
            return
    outcomes.append("never failed")


@pytest.mark.slow
def test_decode_killed_mid_load_leaves_the_prefill_server_with_everything_free(tmp_path):
    producer = EngineArgs(**ENGINE, kv_transfer_config=_config("kv_producer", kv_port=free_port(),
                                                               kv_connector_extra_config={"ttl_s": 3.0}))
    with running_server(producer) as prefill, \
            _process(tmp_path, *FLAGS, "--kv-transfer-config", _config("kv_consumer")) as (decode, decode_url), \
            running_proxy(prefill.base_url, decode_url, health_interval_s=0.5) as proxy:
        model = prefill.client().models.list().data[0].id
        started, outcomes = threading.Event(), []
        clients = [threading.Thread(target=_stream_until_error, args=(proxy.base_url, model, started, outcomes),
                                    daemon=True) for _ in range(2)]
        for c in clients:
            c.start()
        assert started.wait(60), "no stream started through the proxy"
        decode.send_signal(signal.SIGKILL)  # mid-stream, with more prefills arriving
        for c in clients:
            c.join(60)
        assert len(outcomes) == 2 and "never failed" not in outcomes
        # every block and slot free on the prefill server, nothing running, within the store's ttl
        assert wait_for(lambda: _all_free(prefill.base_url), 10), _metrics(prefill.base_url)
        assert _metrics(prefill.base_url)["rocm_k3_kv_transfer_published_total"] >= 1
        store = prefill.engine.core.executor.worker.connector.store
        assert wait_for(lambda: store.num_entries() == 0, 10)  # ttl 3 s: caches no consumer fetched are gone
        assert complete(prefill.client(), model, PROMPTS[0], False)  # the prefill server still serves
        assert wait_for(lambda: _proxy_status(proxy) == 503, 10)  # the proxy's health: no decode instance is left


def _proxy_status(proxy) -> int:
    try:
        return urllib.request.urlopen(proxy.url("/health"), timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
def test_prefill_killed_makes_the_proxy_fall_back_and_answer(tmp_path):
    consumer = EngineArgs(**ENGINE, kv_transfer_config=_config("kv_consumer", timeout_s=3.0))
    with running_server(consumer) as decode, \
            _process(tmp_path, *FLAGS, "--kv-transfer-config", _config("kv_producer", kv_port=free_port())) as (
                prefill, prefill_url), \
            running_proxy(prefill_url, decode.base_url, health_interval_s=0.5) as proxy:
        client = decode.client()
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Say hello."}]
        expected = [complete(client, model, p, s) for p in PROMPTS for s in (False, True)]
        expected.append(chat(client, model, messages, False))
        pclient = proxy.client()
        assert complete(pclient, model, PROMPTS[0], False) == expected[0]  # with the prefill server alive ...
        loaded = _metrics(decode.base_url)["rocm_k3_kv_transfer_requests_total"]
        assert loaded == 1  # ... its cache came over the wire
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(30)
        got = [complete(pclient, model, p, s) for p in PROMPTS for s in (False, True)]
        got.append(chat(pclient, model, messages, False))
        assert got == expected
        m = _metrics(proxy.base_url)
        assert m["rocm_k3_pd_proxy_prefill_fallbacks_total"] == len(expected)
        assert _metrics(decode.base_url)["rocm_k3_kv_transfer_failures_total"] == 0  # no params: no transfer tried
        assert wait_for(lambda: not json.loads(urllib.request.urlopen(proxy.url("/health"), timeout=10).read())[
            "instances"][0]["healthy"], 5)  # the health check keeps the dead instance out
