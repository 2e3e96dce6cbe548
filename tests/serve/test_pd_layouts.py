"""Prefill/decode disaggregation across different TP layouts: a prefill server at TP 2 (two gloo ranks, each
holding half the KDA heads) feeds a decode server at TP 1 through ``pd-proxy``, and the reverse; greedy answers
equal one plain server's, and the decode side loaded every prompt (nothing recomputed)."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from rocm_k3.args import EngineArgs
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.pd_fixtures import chat, complete, free_port, running_proxy
from tests.server_fixtures import running_server

ENGINE = dict(dtype="float32", max_model_len=512)
PROMPTS = ("The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a")
MESSAGES = ([{"role": "user", "content": "Say hello."}],)


def _kv(role: str, tp: int, **extra) -> EngineArgs:
    return EngineArgs(**ENGINE, tensor_parallel_size=tp,
                      kv_transfer_config=json.dumps({"kv_connector": "SocketConnector", "kv_role": role, **extra}))


def _metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.url("/metrics"), timeout=10).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _answers(client, few: bool) -> list[str]:
    """6 completions + 2 chats, streaming and not (``few``: one completion and one streamed chat)."""
    model = client.models.list().data[0].id
    if few:
        return [complete(client, model, PROMPTS[2], False), chat(client, model, MESSAGES[0], True)]
    out = [complete(client, model, p, s) for p in PROMPTS for s in (False, True)]
    return out + [chat(client, model, m, s) for m in MESSAGES for s in (False, True)]


@pytest.mark.dist
@pytest.mark.parametrize("prefill_tp, decode_tp", [pytest.param(2, 1, id="prefill-tp2-decode-tp1"),
                                                   pytest.param(1, 2, id="prefill-tp1-decode-tp2",
                                                                marks=pytest.mark.slow)])
def test_different_tp_layouts_give_one_plain_servers_tokens(prefill_tp, decode_tp):
    few = decode_tp > 1  # a TP-2 decode is the slow side on the CPU: two requests show its cut of the heads
    with running_server(EngineArgs(**ENGINE)) as plain:
        expected = _answers(plain.client(), few)
    with running_server(_kv("kv_producer", prefill_tp, kv_port=free_port())) as prefill, \
            running_server(_kv("kv_consumer", decode_tp, timeout_s=10.0)) as decode, \
            running_proxy(prefill.base_url, decode.base_url) as proxy:
        assert _answers(proxy.client(), few) == expected
        n = len(expected)
        assert _metric(decode, "rocm_k3_kv_transfer_requests_total") == n  # every prompt came over the wire ...
        assert _metric(decode, "rocm_k3_kv_transfer_failures_total") == 0  # ... and none was recomputed
        assert _metric(prefill, "rocm_k3_kv_transfer_published_total") == n
