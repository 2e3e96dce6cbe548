"""Prefill/decode disaggregation end to end: a prefill server (kv_producer), a decode server (kv_consumer) and
``pd-proxy`` on 127.0.0.1 with the embedded model, against one plain server.

The decode server must not compute the prompts itself: its transfer counter grows by one per request, its
recompute counter stays 0 and it computes one prefill token per request (the last prompt token, by the N - 1
convention). A transfer corrupted on the wire (a relay between the two servers flips a payload byte) is caught by
the checksum and the decode server recomputes that prompt: the answer is still right. A published prompt that no
decode instance fetches (a consumer that died) leaves the producer's store within its ttl.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import threading
import time
import urllib.request

import pytest

from rocm_k3.args import EngineArgs
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.pd_fixtures import chat as _chat
from tests.pd_fixtures import complete as _complete
from tests.pd_fixtures import free_port as _free_port
from tests.pd_fixtures import running_proxy as _proxy
from tests.server_fixtures import running_server

ENGINE = dict(dtype="float32", max_model_len=1024)
PROMPTS = ("The capital of France is", "1, 2, 3, 4,", "Once upon a time", "a", "The quick brown fox jumps over the",
           "Hello, my name is", "def fib(n):", "Water boils at", "Roses are red,", "In 1492 Columbus")
MESSAGES = ([{"role": "user", "content": "Say hello."}], [{"role": "user", "content": "Count to five."}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
            [{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": "Write a haiku."}])


def _kv(role: str, **extra) -> EngineArgs:
    return EngineArgs(**ENGINE, kv_transfer_config=json.dumps({"kv_connector": "SocketConnector", "kv_role": role,
                                                               **extra}))


def _answers(client, prompts=PROMPTS, messages=MESSAGES) -> list[str]:
    model = client.models.list().data[0].id
    out = [_complete(client, model, p, s) for p in prompts for s in (False, True)]
    return out + [_chat(client, model, m, s) for m in messages for s in (False, True)]


def _full(client) -> list[str]:
    """50 requests: 10 prompts + 5 chats, streaming and not, then the prompts again."""
    return _answers(client) + _answers(client, PROMPTS, ())


def _quick(client) -> list[str]:
    """12 requests: 4 prompts (one of one token) + 2 chats, streaming and not."""
    return _answers(client, PROMPTS[:4], MESSAGES[:2])


def _metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.url("/metrics"), timeout=10).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def servers():
    port = _free_port()
    with running_server(EngineArgs(**ENGINE)) as plain, \
            running_server(_kv("kv_producer", kv_port=port, kv_connector_extra_config={"ttl_s": 3.0})) as prefill, \
            running_server(_kv("kv_consumer", timeout_s=5.0)) as decode:
        yield plain, prefill, decode


@pytest.mark.parametrize("requests", [pytest.param(_quick, id="12-requests"),
                                      pytest.param(_full, id="50-requests", marks=pytest.mark.slow)])
def test_proxy_moves_the_prompt_cache_and_outputs_equal_one_plain_server(servers, requests):
    plain, prefill, decode = servers
    expected = requests(plain.client())
    loaded0 = _metric(decode, "rocm_k3_kv_transfer_requests_total")
    failures0 = _metric(decode, "rocm_k3_kv_transfer_failures_total")
    prefill_tokens0 = decode.engine.stats()["prefill_tokens"]
    with _proxy(prefill.base_url, decode.base_url) as proxy:
        assert requests(proxy.client()) == expected
    n = len(expected)
    # every request's prompt came over the wire (the one-token prompt "a" has nothing to move: N - 1 = 0) ...
    loaded = _metric(decode, "rocm_k3_kv_transfer_requests_total") - loaded0
    assert loaded >= n - 4
    assert _metric(decode, "rocm_k3_kv_transfer_failures_total") == failures0  # ... and nothing was recomputed
    assert _metric(decode, "rocm_k3_kv_transfer_received_bytes_total") > 0
    assert _metric(prefill, "rocm_k3_kv_transfer_published_total") >= loaded
    # the decode server computed one prompt token per request: the last one (the N - 1 convention)
    assert decode.engine.stats()["prefill_tokens"] - prefill_tokens0 == n


class _CorruptingRelay:
    """A TCP relay in front of the producer's block store that flips one byte of the first payload it forwards
    back (the wire format: 4-byte header length, JSON header with ``nbytes``, payload)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.flipped = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(self.target, timeout=10)
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise OSError("closed")
            buf += chunk
        return buf

    def _answers(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                raw_len = self._exact(src, 4)
                header = self._exact(src, struct.unpack(">I", raw_len)[0])
                payload = bytearray(self._exact(src, int(json.loads(header).get("nbytes", 0))))
                if payload and not self.flipped:
                    payload[len(payload) // 2] ^= 0x10
                    self.flipped += 1
                dst.sendall(raw_len + header + bytes(payload))
        with contextlib.suppress(OSError):
            dst.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


def test_corrupted_transfer_is_detected_and_the_prompt_recomputed(servers):
    plain, prefill, decode = servers
    body = {"model": plain.client().models.list().data[0].id, "prompt": "The capital of France is",
            "max_tokens": 8, "temperature": 0.0}
    expected = _post(plain.url("/v1/completions"), body)["choices"][0]["text"]
    answer = _post(prefill.url("/v1/completions"), {**body, "max_tokens": 1,
                                                     "kv_transfer_params": {"do_remote_decode": True}})
    params = answer["kv_transfer_params"]
    assert params["remote_num_tokens"] > 0
    relay = _CorruptingRelay((params["remote_host"], params["remote_port"]))
    failures0 = _metric(decode, "rocm_k3_kv_transfer_failures_total")
    try:
        got = _post(decode.url("/v1/completions"), {**body, "kv_transfer_params": {**params,
                                                                                    "remote_port": relay.port}})
    finally:
        relay.close()
    assert relay.flipped == 1
    assert got["choices"][0]["text"] == expected
    assert _metric(decode, "rocm_k3_kv_transfer_failures_total") == failures0 + 1


def test_unfetched_prompt_cache_leaves_the_producer_within_its_ttl(servers):
    plain, prefill, _ = servers
    store = prefill.engine.core.executor.worker.connector.store
    body = {"model": plain.client().models.list().data[0].id, "prompt": "Once upon a time there was",
            "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": True}}
    params = _post(prefill.url("/v1/completions"), body)["kv_transfer_params"]
    assert any(k.startswith(params["remote_transfer_id"] + "/") for k in list(store._entries))
    deadline = time.monotonic() + 2  # the stats snapshot follows the engine's last step
    while (lambda st: st["free_blocks"] != st["num_blocks"])(prefill.engine.stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = prefill.engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == 0  # blocks freed at once
    deadline = time.monotonic() + 10  # ttl 3 s: the consumer never came (died mid-transfer)
    while store.num_entries() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.num_entries() == 0


def test_kv_transfer_config_is_validated_at_the_boundary():
    with pytest.raises(ValueError, match="kv_role must be one of"):
        EngineArgs(kv_transfer_config='{"kv_connector": "SocketConnector", "kv_role": "decode"}').validated()
    with pytest.raises(ValueError, match="pip install nixl"):
        EngineArgs(kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}).validated()
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        EngineArgs(pipeline_parallel_size=2, kv_transfer_config='{"kv_connector": "SocketConnector", '
                                                                 '"kv_role": "kv_both"}').validated()


def _respond(client, model, stream: bool, previous: str | None = None) -> tuple[str, str]:
    """(reasoning + answer text, response id) of a greedy /v1/responses call (a follow-up of ``previous``)."""
    kw = dict(model=model, input="Name a colour." if previous is None else "And another one?",
              max_output_tokens=8, temperature=0.0, previous_response_id=previous)
    if not stream:
        r = client.responses.create(**kw)
        return "".join(part.text for item in r.output for part in item.content or ()), r.id
    text, rid = "", ""
    for event in client.responses.create(stream=True, **kw):
        if event.type in ("response.reasoning_text.delta", "response.output_text.delta"):
            text += event.delta
        elif event.type == "response.created":
            rid = event.response.id
    return text, rid


def test_responses_through_the_proxy_move_the_cache_and_follow_ups_stay_on_their_decode_instance(servers):
    plain, prefill, decode = servers
    model = plain.client().models.list().data[0].id
    loaded0 = _metric(decode, "rocm_k3_kv_transfer_requests_total")
    failures0 = _metric(decode, "rocm_k3_kv_transfer_failures_total")
    with _proxy(prefill.base_url, decode.base_url) as proxy:
        for stream in (False, True):
            text, rid = _respond(plain.client(), model, stream)
            got, got_id = _respond(proxy.client(), model, stream)
            assert got == text and text and got_id.startswith("resp_")
            # the follow-up's conversation is stored on the decode instance: the proxy sends it there
            assert _respond(proxy.client(), model, stream, got_id)[0] == _respond(plain.client(), model, stream,
                                                                                   rid)[0]
    assert _metric(decode, "rocm_k3_kv_transfer_requests_total") - loaded0 == 2  # the two first turns
    assert _metric(decode, "rocm_k3_kv_transfer_failures_total") == failures0
