"""An asyncio front over one :class:`~rocm_k3.engine.core.EngineCore`: the server's way to the engine.

The engine is synchronous (one ``step()`` runs one forward pass), so it gets a thread of its own: the engine
thread owns the core and runs the step loop while requests exist, sleeping otherwise. Everything else talks to
it through a command queue:

- :meth:`AsyncLLM.add_request` posts the request and waits until the engine thread has queued it; a bad request
  raises the engine's ValueError / TypeError (e.g. ``RequestTooLargeError``) there, before any output;
- the engine thread hands each step's deltas to the request's :class:`RequestStream` on the caller's event loop
  with ``loop.call_soon_threadsafe`` (the only cross-thread path of outputs), so many requests stream at once
  under continuous batching;
- closing or cancelling a stream before it finished (a client that disconnects) aborts its request: the engine
  thread frees its cache before the next step;
- an exception escaping ``step()``, or a worker process found dead (checked every ``HEALTH_POLL_S`` while idle),
  marks the engine dead: every in-flight request fails with
  :class:`EngineDeadError` (nothing hangs), later requests are refused with it, and :attr:`AsyncLLM.is_dead` is set
  (the server answers 503).

:meth:`AsyncLLM.stats` is a snapshot of ``EngineCore.stats()`` the engine thread publishes after every step and
every batch of commands (reading the core from another thread would race the step loop).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from rocm_k3.engine.core import EngineCore
from rocm_k3.engine.outputs import RequestDelta
from rocm_k3.sampling_params import SamplingParams

log = logging.getLogger("rocm_k3.engine")

HEALTH_POLL_S = 1.0  # an idle engine thread checks its workers' processes this often


class EngineDeadError(RuntimeError):
    """The engine failed (or was shut down) and serves no more requests."""


@dataclasses.dataclass
class _Command:
    kind: str  # "add" | "abort"
    request_id: str
    prompt_token_ids: Sequence[int] = ()
    params: SamplingParams | None = None
    stream: RequestStream | None = None
    images: tuple = ()  # ImageInput items (rocm_k3.engine.multimodal)


class RequestStream:
    """The deltas of one request, as an async iterator (ends after the delta with ``finished`` set).

    ``close()`` (or cancelling the task that iterates) before the end aborts the request. Raises
    EngineDeadError if the engine fails meanwhile.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self.finished = False
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Stop listening; aborts the request when it has not finished."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self._engine.abort(self.request_id)

    # ---- called on the stream's loop (through call_soon_threadsafe) -----------------------------------------
    def _push(self, item: RequestDelta | BaseException) -> None:
        if not self.closed:
            self._queue.put_nowait(item)

    def _resolve(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)


class AsyncLLM:
    """See the module docstring. ``core``: the engine core this front owns from now on (no other thread may
    touch it). The engine thread starts at once and stops with :meth:`shutdown`."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._cond = threading.Condition()
        self._commands: collections.deque[_Command] = collections.deque()
        self._streams: dict[str, RequestStream] = {}  # guarded by _cond
        self._stop = False
        self._dead: BaseException | None = None
        self._shut_down = False  # shutdown() before any failure
        self._stats: dict[str, float] = core.stats()
        self._expert_loads: dict[int, list[int]] = {}
        self._loads_wanted = False
        self._loads_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rocm-k3-engine", daemon=True)
        self._thread.start()

    # ---- the caller's side ---------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def failed(self) -> bool:
        """True when the engine died of an error (a shut-down engine is dead but has not failed)."""
        return self._dead is not None and not self._shut_down

    @property
    def dead_reason(self) -> str | None:
        return None if self._dead is None else f"{type(self._dead).__name__}: {self._dead}"

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                          params: SamplingParams, *, images: Sequence[Any] = ()) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it (its errors are raised here).

        images: the prompt's ImageInputs (``MultiModalProcessor`` output: ``mm.token_ids`` with ``mm.images``)."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        with self._cond:
            self._check_alive()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.append(_Command("add", request_id, list(prompt_token_ids), params, stream, tuple(images)))
            self._cond.notify()
        try:
            await asyncio.shield(stream._accepted)
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            with self._cond:
                self._streams.pop(request_id, None)
            stream.closed = True
            raise
        return stream

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str, *,
                       images: Sequence[Any] = ()) -> AsyncIterator[RequestDelta]:
        """The deltas of one request; leaving the loop early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt_token_ids, params, images=images)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it is unknown or finished); its stream gets nothing more."""
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.closed = True
            if self._dead is None:
                self._commands.append(_Command("abort", request_id))
                self._cond.notify()

    def stats(self) -> dict[str, float]:
        """The engine counters after the latest step (see ``EngineCore.stats``)."""
        return dict(self._stats)

    def expert_loads(self, timeout: float = 2.0) -> dict[int, list[int]]:
        """Picks per logical expert of each MoE layer (``EngineCore.expert_loads``), read by the engine thread
        between two steps; waits at most ``timeout`` seconds for it, else returns the previous reading."""
        with self._cond:
            if self._dead is not None or self._stop:
                return dict(self._expert_loads)
            self._loads_done.clear()
            self._loads_wanted = True
            self._cond.notify()
        self._loads_done.wait(timeout)
        return dict(self._expert_loads)

    @property
    def num_streams(self) -> int:
        with self._cond:
            return len(self._streams)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (after the step in flight); open streams fail with EngineDeadError."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._shut_down = self._shut_down or self._dead is None  # a second call keeps the first answer
        self._fail(EngineDeadError("the engine was shut down"), log_it=False)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has failed ({self.dead_reason}) and serves no more requests")
        if self._stop:
            raise EngineDeadError("the engine is shutting down")

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while True:
            with self._cond:
                while not self._stop and not self._commands and not core.has_unfinished() and not self._loads_wanted:
                    if not self._cond.wait(HEALTH_POLL_S):
                        break  # idle for a while: check the workers below
                if self._stop:
                    return
                commands = list(self._commands)
                self._commands.clear()
                loads_wanted, self._loads_wanted = self._loads_wanted, False
            try:
                core.check_workers()  # a rank that died while idle fails the engine now, not at the next request
                for cmd in commands:
                    self._apply(cmd)
                if core.has_unfinished():
                    self._deliver(core.step())
                self._stats = core.stats()
                if loads_wanted:
                    self._expert_loads = core.expert_loads()
                    self._loads_done.set()
            except BaseException as exc:  # the engine is unusable: fail everything, never hang
                self._fail(exc)
                return

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind == "abort":
            self.core.abort(cmd.request_id)
            return
        error: BaseException | None = None
        try:
            self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, images=cmd.images)
        except (ValueError, TypeError) as exc:  # the request's own fault (validated before anything is queued)
            error = exc
        self._call(cmd.stream, cmd.stream._resolve, error)  # a caller that left meanwhile queued an abort after us

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            with self._cond:
                stream = self._streams.get(delta.request_id)
                if stream is not None and delta.finished:
                    del self._streams[delta.request_id]
            if stream is not None:
                self._call(stream, stream._push, delta)

    def _call(self, stream: RequestStream, fn, arg: Any) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the stream's event loop is closed: its caller is gone
            if not stream.finished:
                self.core.abort(stream.request_id)

    def _fail(self, exc: BaseException, log_it: bool = True) -> None:
        with self._cond:
            if self._dead is None:
                self._dead = exc
            if log_it:
                log.error("engine failed; %d requests in flight fail with it", len(self._streams), exc_info=exc)
            streams = list(self._streams.values())
            self._streams.clear()
            pending = [c for c in self._commands if c.kind == "add"]
            self._commands.clear()
        error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}") if log_it else exc
        for cmd in pending:
            self._call_quietly(cmd.stream, cmd.stream._resolve, error)
        for stream in streams:
            self._call_quietly(stream, stream._resolve, error)
            self._call_quietly(stream, stream._push, error)

    @staticmethod
    def _call_quietly(stream: RequestStream, fn, arg: Any) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass
