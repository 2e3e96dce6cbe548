"""pd-proxy: a prefill server, a decode server and the proxy on 127.0.0.1 with the embedded model.

Both servers here run without ``--kv-transfer-config``, so the decode server prefills itself (the transfer is
tested in test_pd_end_to_end.py); these tests check the routing: greedy outputs through the proxy equal one plain
server's, streaming and not, and a dead prefill server makes the proxy fall back and still answer.
"""

from __future__ import annotations

import urllib.request

import pytest

from rocm_k3.args import EngineArgs
from rocm_k3.entrypoints.pd_proxy import ProxyConfig
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.pd_fixtures import chat as _chat
from tests.pd_fixtures import complete as _complete
from tests.pd_fixtures import running_proxy as _proxy
from tests.server_fixtures import running_server

ENGINE = EngineArgs(dtype="float32", max_model_len=1024)
PROMPTS = ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")
MESSAGES = ([{"role": "user", "content": "Say hello."}], [{"role": "user", "content": "Count to five."}])


def _answers(client) -> list[str]:
    model = client.models.list().data[0].id
    out = [_complete(client, model, p, s) for p in PROMPTS for s in (False, True)]
    return out + [_chat(client, model, m, s) for m in MESSAGES for s in (False, True)]


@pytest.fixture(scope="module")
def servers():
    with running_server(ENGINE) as prefill, running_server(ENGINE) as decode:
        yield prefill, decode


def test_proxy_outputs_equal_one_plain_server(servers):
    prefill, decode = servers
    plain = _answers(decode.client())
    with _proxy(prefill.base_url, decode.base_url) as proxy:
        assert _answers(proxy.client()) == plain
        metrics = urllib.request.urlopen(proxy.url("/metrics"), timeout=10).read().decode()
    assert 'rocm_k3_pd_proxy_requests_total{route="/v1/completions"} 6.0' in metrics
    assert "rocm_k3_pd_proxy_prefill_fallbacks_total 0.0" in metrics


def test_dead_prefill_server_falls_back_to_decode_side_prefill(servers):
    _, decode = servers
    plain = _answers(decode.client())[:2]
    with running_server(ENGINE) as doomed:
        dead_url = doomed.base_url
    with _proxy(dead_url, decode.base_url) as proxy:
        assert _answers(proxy.client())[:2] == plain
        metrics = urllib.request.urlopen(proxy.url("/metrics"), timeout=10).read().decode()
    assert "rocm_k3_pd_proxy_prefill_fallbacks_total 0.0" not in metrics


def test_proxy_config_rejects_bad_urls():
    with pytest.raises(ValueError, match="prefill_urls needs at least one URL"):
        ProxyConfig((), ("http://127.0.0.1:1",))
    with pytest.raises(ValueError, match="not an http"):
        ProxyConfig(("127.0.0.1:1",), ("http://127.0.0.1:1",))
