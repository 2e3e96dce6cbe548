"""Fetching a request's remote images (``--allow-remote-images``) without letting slow or hostile hosts hurt the
server.

- A dedicated pool of ``workers`` threads (``--image-fetch-workers``) does every fetch; request handlers await
  it, so neither the event loop nor the threads that render other requests ever wait on an image host. Text
  requests and requests with only ``data:`` URLs never touch the pool. One request has at most half the pool's
  threads (at least one) fetching or queued at a time, so its images take turns with other requests' images
  instead of filling the queue.
- One deadline per request (``--image-fetch-timeout`` seconds from when its fetches are queued) covers all of its
  images together, queueing included: a request with ten slow images fails after about ``timeout_s``, not ten
  times that. At the deadline (or at a request's first failed image) its open sockets are shut down, so the pool's
  threads are free again at once; a fetch still waiting in the queue then does nothing.
- Only ``http``/``https``; the host is resolved once and the connection goes to that address, which must pass the
  :class:`~rocm_k3.entrypoints.address_policy.AddressPolicy` (no DNS rebinding between check and connect; TLS
  still checks the certificate against the host name). Redirects are followed by hand, at most ``max_redirects``,
  each hop checked the same way.
- ``max_bytes`` per image: a larger ``Content-Length`` is refused before the body is read, and the body is read in
  pieces and cut off past the limit (chunked answers without a length too).

Every failure is an :class:`ImageFetchError` (a ValueError: the server answers 400 naming the image part, the URL
and the problem; a timeout too, since the client's request was well-formed but cannot be served as sent).
Name resolution (``getaddrinfo``) cannot be interrupted: a request still fails at its deadline, but a pool thread
may stay in the resolver until the system resolver's own timeout. Proxy variables (``http_proxy``) are not used:
the address that is checked is the address connected to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence

from rocm_k3.entrypoints.address_policy import AddressPolicy

REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16


class ImageFetchError(ValueError):
    """A remote image that could not be fetched (refused address, timeout, too large, bad answer)."""


class _Late(ImageFetchError):
    """A fetch cut off by its request's deadline (reported once for the request, with every late URL)."""


@dataclasses.dataclass(frozen=True)
class FetchLimits:
    """The knobs of :class:`ImageFetcher` (the server's ``--image-fetch-*`` flags)."""

    timeout_s: float = 10.0
    max_bytes: int = 20 * 2**20
    max_redirects: int = 3
    allow_private: bool = False

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ValueError(f"image fetch timeout: expected seconds in (0, 3600], got {t!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"max_bytes: expected a positive int, got {self.max_bytes!r}")
        r = self.max_redirects
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 20:
            raise ValueError(f"max_redirects: expected an int in [0, 20], got {r!r}")
        AddressPolicy(self.allow_private)  # ValueError for a non-bool


class _Job:
    """One request's fetches: its deadline, and the sockets to shut down when it ends early."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._ended = False

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, url: str) -> None:
        if self._ended:
            raise ImageFetchError(f"{url}: abandoned (the request ended)")
        if self.remaining() <= 0:
            raise _Late(f"{url}: the request's image fetch deadline passed")

    def watch(self, sock: socket.socket, url: str) -> None:
        with self._lock:
            self._sockets.add(sock)
        self.check(url)  # ended between the connect and now: the caller closes the socket

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)

    def end(self) -> None:
        """Stop every fetch of this job: reads in other threads return at once (shutdown wakes a blocked recv)."""
        with self._lock:
            self._ended = True
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the OS-level shutdown, TLS sockets too
            except OSError:
                pass


class ImageFetcher:
    """A bounded pool that fetches the remote images of requests (see the module docstring)."""

    def __init__(self, workers: int, limits: FetchLimits) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 256:
            raise ValueError(f"image fetch workers: expected an int in [1, 256], got {workers!r}")
        self.limits = limits
        self.policy = AddressPolicy(limits.allow_private)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rocm-k3-image-fetch")
        self.per_request = max(1, workers // 2)  # one request with many slow images holds at most half the pool

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def fetch_all(self, parts: Sequence[tuple[str, str]]) -> dict[str, bytes]:
        """The bytes behind each URL of ``parts`` ((where, url) pairs; a URL given twice is fetched once), all
        within one deadline; the first failure (or the deadline) ends the rest and raises ImageFetchError."""
        first_where = {}
        for where, url in parts:
            first_where.setdefault(url, where)
        if not first_where:
            return {}
        job = _Job(time.monotonic() + self.limits.timeout_s)
        loop = asyncio.get_running_loop()
        share = asyncio.Semaphore(self.per_request)

        async def fetch(url: str) -> bytes:
            async with share:  # a request keeps at most per_request fetches queued or running at a time
                return await loop.run_in_executor(self._pool, self._fetch, url, job)

        tasks = {asyncio.ensure_future(fetch(url)): url for url in first_where}
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.limits.timeout_s,
                                               return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None and not isinstance(task.exception(), _Late):
                    url = tasks[task]
                    raise ImageFetchError(f"{first_where[url]}: {task.exception()}") from None
            late = [url for task, url in tasks.items() if task in pending or task.exception() is not None]
            if late:
                raise ImageFetchError(
                    f"{first_where[late[0]]}: fetching the request's {len(tasks)} remote image(s) did not finish "
                    f"within {self.limits.timeout_s:g} s (--image-fetch-timeout); still waiting for {len(late)}: "
                    + ", ".join(late[:4]))
            return {tasks[task]: task.result() for task in done}
        finally:
            job.end()
            for task in tasks:
                task.cancel()  # a waiting or queued fetch never starts; a running one sees its sockets shut
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: no "exception was never retrieved" log

    def _fetch(self, url: str, job: _Job) -> bytes:
        """One image, following redirects (runs in a pool thread)."""
        original = url
        for _ in range(self.limits.max_redirects + 1):
            status, location, body = self._get(url, job)
            if status not in REDIRECTS:
                return body
            if not location:
                raise ImageFetchError(f"{url}: redirect ({status}) without a Location header")
            url = urllib.parse.urljoin(url, location)
        raise ImageFetchError(f"{original}: more than {self.limits.max_redirects} redirects (last to {url})")

    def _get(self, url: str, job: _Job) -> tuple[int, str | None, bytes]:
        """(status, Location, body) of one GET; the body only for 200 (errors for other statuses)."""
        job.check(url)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ImageFetchError(f"{url}: only http and https image URLs are fetched, not {parts.scheme!r}")
        try:
            host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:  # a port that is not a number or out of range
            raise ImageFetchError(f"{url}: {exc}") from None
        if not host:
            raise ImageFetchError(f"{url}: the URL names no host")
        sockaddr, family = self._resolve(url, host, port)
        conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_type(host, port, timeout=max(job.remaining(), 0.001))

        def connect_to_checked_address(_address, timeout, _source=None) -> socket.socket:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
            except BaseException:
                sock.close()
                raise
            return sock

        conn._create_connection = connect_to_checked_address  # http.client's hook: connect to the checked address
        sock, response = None, None
        try:
            try:
                conn.connect()
                sock = conn.sock
                job.watch(sock, url)
                path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
                conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "rocm-k3"})
                response = conn.getresponse()
                if response.status in REDIRECTS:
                    return response.status, response.getheader("Location"), b""
                if response.status != 200:
                    raise ImageFetchError(f"{url}: the host answered {response.status} {response.reason}")
                return 200, None, self._read_body(url, response, job)
            finally:
                if response is not None:
                    response.close()  # a close-delimited answer owns the socket: this closes it
                if sock is not None:
                    job.forget(sock)
                conn.close()
        except ImageFetchError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if isinstance(exc, TimeoutError):  # the socket timeout is the time left to the deadline
                raise _Late(f"{url}: the request's image fetch deadline passed") from None
            job.check(url)  # ended or past the deadline: say so rather than the socket error that caused
            raise ImageFetchError(f"{url}: cannot fetch ({type(exc).__name__}: {exc})") from None

    def _resolve(self, url: str, host: str, port: int) -> tuple[tuple, int]:
        """(socket address, family) of the first address ``host`` resolves to; 400 naming host and reason when
        the policy refuses it."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise ImageFetchError(f"{url}: cannot resolve host {host!r} ({exc})") from None
        if not infos:
            raise ImageFetchError(f"{url}: host {host!r} resolves to no address")
        family, _, _, _, sockaddr = infos[0]
        reason = self.policy.refusal(sockaddr[0])
        if reason is not None:
            raise ImageFetchError(f"{url}: host {host!r} is refused: {reason}")
        return sockaddr, family

    def _read_body(self, url: str, response: http.client.HTTPResponse, job: _Job) -> bytes:
        limit = self.limits.max_bytes
        declared = response.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise ImageFetchError(f"{url}: the image is larger than the limit of {limit} bytes "
                                  f"(Content-Length {int(declared)})")
        chunks, size = [], 0
        while chunk := response.read(min(_CHUNK, limit + 1 - size)):
            size += len(chunk)
            if size > limit:
                raise ImageFetchError(f"{url}: the image is larger than the limit of {limit} bytes")
            chunks.append(chunk)
            job.check(url)
        return b"".join(chunks)
