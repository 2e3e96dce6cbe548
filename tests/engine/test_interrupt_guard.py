"""InterruptGuard: a SIGINT inside a section is raised at its end, including one whose handler runs while the
guard installs itself (CPython runs pending signal handlers inside ``signal.signal``)."""

from __future__ import annotations

import os
import signal

import pytest

from rocm_k3.engine.guard import InterruptGuard
from tests.model_fixtures import default_sigint  # noqa: F401 (used by name)

pytestmark = pytest.mark.usefixtures("default_sigint")


def test_a_sigint_inside_a_section_is_raised_at_its_end() -> None:
    guard = InterruptGuard()
    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with guard.section():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # handlers run between bytecodes: give it some
                pass
            reached_end = True
    assert reached_end and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_handled_while_the_guard_installs_itself_is_not_lost(monkeypatch) -> None:
    """The handler of a SIGINT that arrived during the C call before the section runs inside ``signal.signal``,
    right after the guard's handler is installed: the section must still raise it."""
    guard = InterruptGuard()
    real = signal.signal

    def install_then_deliver(signum, handler):
        previous = real(signum, handler)
        if handler == guard._handler:  # what CPython does with a signal pending at that moment
            handler(signum, None)
        return previous

    monkeypatch.setattr(signal, "signal", install_then_deliver)
    with pytest.raises(KeyboardInterrupt):
        with guard.section():
            pass
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
