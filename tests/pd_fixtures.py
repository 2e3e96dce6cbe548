"""Test support for prefill/decode disaggregation: the proxy on a free port and greedy completion / chat calls
(streamed or not) whose texts the PD tests compare."""

from __future__ import annotations

import contextlib
import socket
import time

from rocm_k3.entrypoints.pd_proxy import ProxyConfig, build_proxy_app
from tests.server_fixtures import start_app


@contextlib.contextmanager
def running_proxy(prefill_urls: str | tuple[str, ...], decode_urls: str | tuple[str, ...], **config):
    """``pd-proxy`` over those instances on a free port (its health checks stopped at the end)."""
    as_tuple = (lambda u: (u,) if isinstance(u, str) else tuple(u))
    app = build_proxy_app(ProxyConfig(as_tuple(prefill_urls), as_tuple(decode_urls), **{"timeout_s": 60, **config}))
    srv = start_app(app)
    try:
        yield srv
    finally:
        srv.stop()
        app.state.pools.stop()


def complete(client, model, prompt, stream) -> str:
    kw = dict(model=model, prompt=prompt, max_tokens=8, temperature=0.0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


def chat(client, model, messages, stream) -> str:
    kw = dict(model=model, messages=messages, max_tokens=8, temperature=0.0)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a producer's block store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout_s: float = 5.0, poll_s: float = 0.05) -> bool:
    """Poll ``cond()`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
