"""Test support: a hostile image host on 127.0.0.1 (a real HTTP server in a thread) for the remote image fetcher.

Routes (``?anything`` is ignored, so one route can be asked for many times as different URLs):

- ``/ok.png``: the ``body`` with a Content-Length;
- ``/slow``: headers, then nothing for up to ``SLOW_S`` seconds (the client's deadline must end it);
- ``/slow-headers``: nothing at all for up to ``SLOW_S`` seconds;
- ``/huge-declared``: Content-Length of 1 GB, then a trickle (refused before reading);
- ``/huge-close``: no Content-Length, bytes until the client hangs up (HTTP/1.0, close-delimited);
- ``/huge-chunked``: chunked transfer encoding, chunks until the client hangs up;
- ``/loop``: 302 to itself; ``/hops/N``: N redirects, then ``/ok.png``;
- ``/to?url=...``: 302 to the given URL; ``/missing``: 404.

``sent`` counts the bytes of huge bodies written (to show a client stopped reading early), ``connections`` the
requests seen, ``active`` the requests still being answered. Everything ends when the fixture stops the server.
"""

from __future__ import annotations

import contextlib
import http.server
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator

SLOW_S = 20.0
_PIECE = b"\0" * 65536


class ImageHost:
    """The server's shared state (read by tests, written by handler threads)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.connections = 0
        self.active = 0
        self.base = ""

    def url(self, path: str) -> str:
        return self.base + path


def _handler(host: ImageHost) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            with host.lock:
                host.connections += 1
                host.active += 1
            try:
                self._route()
            except OSError:
                pass  # the client hung up: what the size and deadline tests expect
            finally:
                with host.lock:
                    host.active -= 1
                self.close_connection = True

        def _route(self) -> None:
            parts = urllib.parse.urlsplit(self.path)
            path = parts.path
            if path == "/ok.png":
                self._head(200, {"Content-Type": "image/png", "Content-Length": str(len(host.body))})
                self.wfile.write(host.body)
            elif path == "/slow":
                self._head(200, {"Content-Type": "image/png", "Content-Length": "1000"})
                self.wfile.flush()
                self._idle()
            elif path == "/slow-headers":
                self._idle()
            elif path == "/huge-declared":
                self._head(200, {"Content-Type": "image/png", "Content-Length": str(10**9)})
                self._flood(lambda piece: piece)
            elif path == "/huge-close":
                self.protocol_version = "HTTP/1.0"
                self._head(200, {"Content-Type": "image/png", "Connection": "close"})
                self._flood(lambda piece: piece)
            elif path == "/huge-chunked":
                self._head(200, {"Content-Type": "image/png", "Transfer-Encoding": "chunked"})
                self._flood(lambda piece: b"%x\r\n%s\r\n" % (len(piece), piece))
            elif path == "/loop":
                self._head(302, {"Location": "/loop", "Content-Length": "0"})
            elif path.startswith("/hops/"):
                left = int(path.rsplit("/", 1)[1])
                self._head(302, {"Location": f"/hops/{left - 1}" if left > 1 else "/ok.png", "Content-Length": "0"})
            elif path == "/to":
                target = urllib.parse.parse_qs(parts.query)["url"][0]
                self._head(302, {"Location": target, "Content-Length": "0"})
            else:
                self._head(404, {"Content-Length": "0"})

        def _head(self, status: int, headers: dict[str, str]) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()

        def _idle(self) -> None:
            """Send nothing for up to SLOW_S seconds, or until the client hangs up or the test ends."""
            deadline = time.monotonic() + SLOW_S
            while time.monotonic() < deadline and not host.stop.is_set():
                readable, _, _ = select.select([self.connection], [], [], 0.05)
                if readable and not self.connection.recv(1, socket.MSG_PEEK):
                    return  # EOF: the client is gone

        def _flood(self, frame) -> None:
            """Write up to 1 GB in pieces until the client hangs up (or the test ends)."""
            for _ in range(10**9 // len(_PIECE)):
                if host.stop.is_set():
                    return
                self.wfile.write(frame(_PIECE))
                with host.lock:
                    host.sent += len(_PIECE)

    return Handler


@contextlib.contextmanager
def image_host(body: bytes, address: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> Iterator[ImageHost]:
    """Serve an :class:`ImageHost` on ``address`` (a free port) for the block; over TLS with a server context."""
    host = ImageHost(body)
    httpd = http.server.ThreadingHTTPServer((address, 0), _handler(host))
    httpd.daemon_threads = True
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), name="test-image-host", daemon=True)
    thread.start()
    host.base = f"{'https' if tls else 'http'}://{address}:{httpd.server_address[1]}"
    try:
        yield host
    finally:
        host.stop.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 10 ms for up to ``timeout_s`` seconds; AssertionError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)
