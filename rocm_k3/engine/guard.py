"""Atomic bookkeeping under Ctrl-C: :class:`InterruptGuard` holds SIGINT back for the length of a block.

The scheduler and the cache manager change several structures per decision (queues, block tables, refcounts, the
prefix index). A KeyboardInterrupt landing between two of those changes would leave them inconsistent, so the
engine core runs each bookkeeping section inside its guard: a SIGINT that arrives meanwhile is remembered and
raised as KeyboardInterrupt when the section has finished, at a consistent state. Signals are only delivered to
the main thread, so in other threads the guard does nothing; nested sections defer to the outermost one.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class InterruptGuard:
    """``with guard.section(): ...`` runs the block with SIGINT deferred to its end (main thread only)."""

    def __init__(self) -> None:
        self._depth = 0
        self._pending = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self._pending = True

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        if self._depth == 0:
            # pending is cleared before the handler goes in: signal.signal runs the handler of a SIGINT that
            # arrived during the C call before it (e.g. a long tensor op) right after installing it, and clearing
            # afterwards would lose that Ctrl-C
            self._pending = False
            self._previous = signal.signal(signal.SIGINT, self._handler)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                signal.signal(signal.SIGINT, self._previous)
                if self._pending:
                    self._pending = False
                    raise KeyboardInterrupt
