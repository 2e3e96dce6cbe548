"""The proxy's two pools of instances: health (a periodic ``GET /health``; an instance that fails it, or refuses a
connection, is taken out until a check passes again) and load (requests in flight per instance; a pick takes the
healthy instance with the fewest, round-robin among ties)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator


@dataclasses.dataclass
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    healthy: bool = True
    in_flight: int = 0


class Pools:
    """Both pools; thread-safe (the proxy's handlers run in a thread pool)."""

    def __init__(self, prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], health_interval_s: float,
                 health_timeout_s: float) -> None:
        self.instances = [Instance(u.rstrip("/"), "prefill") for u in prefill_urls] + \
                         [Instance(u.rstrip("/"), "decode") for u in decode_urls]
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self._lock = threading.Lock()
        self._turn = {"prefill": 0, "decode": 0}  # round-robin among equally loaded, per pool
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pick(self, role: str, exclude: tuple[str, ...] = (), healthy_only: bool = True) -> Instance | None:
        """The least-loaded healthy instance of ``role`` not in ``exclude`` (None when there is none)."""
        with self._lock:
            pool = [i for i in self.instances if i.role == role and i.url not in exclude
                    and (i.healthy or not healthy_only)]
            if not pool:
                return None
            least = min(i.in_flight for i in pool)
            ties = [i for i in pool if i.in_flight == least]
            self._turn[role] += 1
            return ties[self._turn[role] % len(ties)]

    def by_url(self, url: str) -> Instance | None:
        return next((i for i in self.instances if i.url == url), None)

    def acquire(self, inst: Instance) -> None:
        """One more request in flight on ``inst`` (until :meth:`release`)."""
        with self._lock:
            inst.in_flight += 1

    def release(self, inst: Instance) -> None:
        with self._lock:
            inst.in_flight -= 1

    @contextlib.contextmanager
    def use(self, inst: Instance) -> Iterator[Instance]:
        """Count a request in flight on ``inst`` while the block runs."""
        self.acquire(inst)
        try:
            yield inst
        finally:
            self.release(inst)

    def set_health(self, inst: Instance, healthy: bool) -> None:
        with self._lock:
            inst.healthy = healthy

    def check(self, inst: Instance) -> bool:
        """One ``GET /health``: 200 puts the instance (back) in its pool, anything else takes it out."""
        try:
            with urllib.request.urlopen(inst.url + "/health", timeout=self.health_timeout_s) as resp:  # noqa: S310
                ok = resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            ok = False
        self.set_health(inst, ok)
        return ok

    def start(self) -> None:
        """Check every instance every ``health_interval_s`` on a background thread until :meth:`stop`."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                for inst in self.instances:
                    self.check(inst)
                self._stop.wait(self.health_interval_s)

        self._thread = threading.Thread(target=loop, name="pd-proxy-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.health_timeout_s + 1)
            self._thread = None
