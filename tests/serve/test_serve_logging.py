"""``rocm-k3 serve`` logs as vLLM / SGLang users expect (issue 31, item 2): ``--log-level``, an ``x-request-id``
on every response (the client's when sane, else a new one that also names the engine request), the id in every
log line of a request, exactly one INFO line per client disconnect, and no traceback when Ctrl-C lands with a
stream in flight (once: the drain ends it with an error event and ``[DONE]``; twice: the server exits at once)."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from rocm_k3.args import ServerArgs
from rocm_k3.cli import build_parser
from rocm_k3.settings import override
from tests.server_fixtures import spawn_serve

HEX_ID = re.compile(r"[0-9a-f]{32}")


# ------------------------------------------------------------------------------------------------ --log-level
def test_log_level_flag_sets_ours_and_uvicorns() -> None:
    ns = build_parser().parse_args(["serve", "--log-level", "debug"])
    args = ServerArgs.from_cli(ns)
    assert (args.resolved_log_level, args.resolved_uvicorn_log_level) == ("debug", "debug")
    ns = build_parser().parse_args(["serve", "--log-level", "error", "--uvicorn-log-level", "info"])
    args = ServerArgs.from_cli(ns)
    assert (args.resolved_log_level, args.resolved_uvicorn_log_level) == ("error", "info")
    with override(log_level="INFO"):  # no flag: ROCM_K3_LOG_LEVEL stays the default
        assert (ServerArgs().resolved_log_level, ServerArgs().resolved_uvicorn_log_level) == ("info", "info")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "loud"])
    with pytest.raises(ValueError, match="log_level: expected one of"):
        ServerArgs(log_level="loud")


def test_an_unexpected_500_carries_the_id_in_its_header_and_log_line() -> None:
    """The id wraps every layer: the server-error layer's 500 and its traceback line name it too."""
    from rocm_k3.entrypoints.openai.api_server import _App
    from rocm_k3.entrypoints.openai.errors import install_error_handlers
    from rocm_k3.entrypoints.openai.request_ids import RequestIdFilter
    from tests.server_fixtures import start_app

    app = _App()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaboom")

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.addFilter(RequestIdFilter())
    handler.emit = records.append
    logger = logging.getLogger("rocm_k3.server")
    logger.addHandler(handler)
    running = start_app(app)
    try:
        req = urllib.request.Request(running.url("/boom"), headers={"x-request-id": "boom-1"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 500 and err.value.headers["x-request-id"] == "boom-1"
        assert "kaboom" in json.loads(err.value.read())["error"]["message"]
    finally:
        running.stop()
        logger.removeHandler(handler)
    assert [r.request_id for r in records if "unexpected error" in r.getMessage()] == ["boom-1"]


# ------------------------------------------------------------------------------------- a real server, its log
def _start(workdir, *flags: str):
    return spawn_serve(workdir, "--dtype", "float32", "--max-model-len", "512", "--log-level", "info", *flags)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc, port, log = _start(tmp_path_factory.mktemp("logging"), "--shutdown-timeout", "1")
    yield proc, port, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _post(port: int, body: dict, headers: dict | None = None, route: str = "/v1/completions"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def _open_stream(port: int, body: dict) -> tuple[socket.socket, str]:
    """Send a request on a raw socket and read until its headers and first bytes; returns (socket, request id)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    return sock, re.search(rb"x-request-id: (\S+)", got).group(1).decode()


def test_every_response_carries_a_request_id(served) -> None:
    _, port, _ = served
    status, headers, body = _post(port, {"prompt": "Hi", "max_tokens": 2}, {"x-request-id": "client-id.7"})
    assert status == 200 and headers["x-request-id"] == "client-id.7"
    assert json.loads(body)["id"].startswith("cmpl-client-id.7-")  # the engine id starts with it
    status, headers, body = _post(port, {"prompt": "Hi", "max_tokens": 2})
    rid = headers["x-request-id"]
    assert HEX_ID.fullmatch(rid) and json.loads(body)["id"] == f"cmpl-{rid}"
    for insane in ("x" * 129, "has space", "ümlaut", ""):
        _, headers, _ = _post(port, {"prompt": "Hi", "max_tokens": 1}, {"x-request-id": insane.encode().decode(
            "latin-1")})
        assert HEX_ID.fullmatch(headers["x-request-id"]), insane
    status, headers, _ = _post(port, {"prompt": "Hi", "top_p": 7}, {"x-request-id": "bad-one"})
    assert status == 400 and headers["x-request-id"] == "bad-one"
    status, headers, _ = _post(port, {}, {"x-request-id": "no-route"}, route="/v1/nothing")
    assert status == 404 and headers["x-request-id"] == "no-route"
    chat_status, chat_headers, chat = _post(port, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                                            {"x-request-id": "chat-1"}, route="/v1/chat/completions")
    assert chat_status == 200 and chat_headers["x-request-id"] == "chat-1"
    assert json.loads(chat)["id"].startswith("chatcmpl-chat-1-")


def test_log_lines_of_a_request_carry_its_id(served) -> None:
    _, port, log = served
    _post(port, {"prompt": "Hi", "max_tokens": 1, "not_a_field": 1}, {"x-request-id": "unknown-field-1"})
    time.sleep(0.3)
    lines = [line for line in log.read_text().splitlines() if "not_a_field" in line]
    assert len(lines) == 1 and "[unknown-field-1]" in lines[0] and "WARNING" in lines[0], lines
    access = [line for line in log.read_text().splitlines() if "[unknown-field-1]" in line and "POST" in line]
    assert len(access) == 1, access  # uvicorn's access line too


def test_one_info_line_per_client_disconnect(served) -> None:
    _, port, log = served
    ids = []
    for _ in range(3):  # streams dropped after their first event
        sock, rid = _open_stream(port, {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True})
        sock.close()
        ids.append(rid)
    for i in range(2):  # whole answers the client stops waiting for
        rid = f"gone-{i}"
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        data = json.dumps({"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     + f"x-request-id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(0.3)
        sock.close()
        ids.append(rid)
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)  # gone while its body is being read
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"x-request-id: half-body\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    time.sleep(0.3)
    sock.close()
    ids.append("half-body")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = log.read_text()
        lines = [line for line in text.splitlines() if "disconnected" in line]
        if len(lines) >= len(ids):
            break
        time.sleep(0.1)
    time.sleep(0.5)  # nothing more comes
    text = log.read_text()
    lines = [line for line in text.splitlines() if "disconnected" in line]
    assert len(lines) == len(ids), lines
    for rid in ids:
        mine = [line for line in lines if f"[{rid}]" in line]
        assert len(mine) == 1 and mine[0].startswith("INFO"), (rid, lines)
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]


def _stream_in_flight(port: int, out: dict) -> threading.Thread:
    def run() -> None:
        status, _, body = _post(port, {"prompt": "Hi", "max_tokens": 240, "ignore_eos": True, "stream": True})
        out["events"] = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        out["status"] = status

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)  # tokens are flowing
    return thread


def test_ctrl_c_with_a_stream_in_flight_drains_without_a_traceback(served) -> None:
    """Last test of the module: it stops the server."""
    proc, port, log = served
    out: dict = {}
    thread = _stream_in_flight(port, out)
    proc.send_signal(signal.SIGINT)
    thread.join(60)
    code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert out["status"] == 200 and out["events"][-1] == "[DONE]"
    assert any("error" in json.loads(e) for e in out["events"][:-1]), "the drain's timeout ended it with an error"
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]


@pytest.mark.slow  # a server of its own
def test_second_ctrl_c_with_a_stream_in_flight_exits_without_a_traceback(tmp_path) -> None:
    proc, port, log = _start(tmp_path, "--shutdown-timeout", "60")
    try:
        out: dict = {}
        thread = _stream_in_flight(port, out)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
        thread.join(60)
        text = log.read_text()
        assert code == 0, text[-3000:]
        assert "second signal" in text
        assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
