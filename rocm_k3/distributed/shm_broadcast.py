"""One writer, several readers on one node: a ring of fixed-size message slots in shared memory.

The file (on ``/dev/shm`` where it exists) holds a header and ``num_slots`` slots::

    header: writer pid (int64), then one int64 per reader: its pid (0 until it attached)
    slot:   seq (int64: the message number written there, 0 = never), nbytes (int64, < 0: the message of -nbytes
            went by the overflow channel), one flag byte per reader (1 = read / free), padding, then slot_bytes data

The writer puts message ``s`` (1, 2, ...) into slot ``(s - 1) % num_slots`` once every reader has flagged the
message before it in that slot as read (a slow reader holds the writer back by at most ``num_slots`` messages),
clears the flags and publishes ``seq`` last. A reader waits for the ``seq`` it expects, copies the data out and sets
its flag. A message larger than a slot is announced in its slot and sent through ``overflow`` (a torch.distributed
broadcast in the executor). Waiting polls: a spin with ``sched_yield`` for ``spin_s`` (short on a CPU group whose
ranks share cores; long on GPU nodes, where a sleeping reader would add its wake-up to every step), then sleeps
growing to 1 ms.

No hang: a writer waiting on a reader checks the readers' processes every ~50 ms and raises
:class:`BroadcastError` naming a reader whose process has ended, or one that did not read within ``timeout_s``;
a reader waiting for the next message raises when the writer's process has ended.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time
from collections.abc import Callable

from rocm_k3.checks import check_int

_Q = struct.Struct("<q")
SPIN_S = 100e-6  # by default, poll with sched_yield this long before sleeping
_MAX_SLEEP_S = 1e-3
_CHECK_S = 0.05  # how often a waiting side checks that its peers' processes still live


class BroadcastError(RuntimeError):
    """A peer of the ring is gone (its process ended) or did not answer within the timeout."""


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Where the ring lives and its geometry (validated); the writer creates the file, readers attach to it."""

    path: str
    num_readers: int
    num_slots: int = 4
    slot_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("num_readers", "num_slots", "slot_bytes"):
            check_int(name, getattr(self, name))
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"path: expected a file path, got {self.path!r}")

    @property
    def header_bytes(self) -> int:
        return 8 * (1 + self.num_readers)

    @property
    def slot_header_bytes(self) -> int:
        return 16 + (self.num_readers + 7) // 8 * 8

    @property
    def slot_stride(self) -> int:
        return self.slot_header_bytes + self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.num_slots * self.slot_stride


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class ShmRing:
    """See the module docstring. Build with :meth:`create` (the writer) or :meth:`attach` (reader ``index``)."""

    def __init__(self, spec: RingSpec, reader: int | None, fd: int) -> None:
        self.spec = spec
        self.reader = reader
        self.spin_s = SPIN_S
        self._mm = mmap.mmap(fd, spec.total_bytes)
        os.close(fd)
        self._seq = 0  # the last message written (writer) / read (reader)

    @classmethod
    def create(cls, spec: RingSpec) -> ShmRing:
        fd = os.open(spec.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, spec.total_bytes)
        ring = cls(spec, None, fd)
        _Q.pack_into(ring._mm, 0, os.getpid())
        for slot in range(spec.num_slots):  # every flag "read": all slots free
            off = ring._slot(slot) + 16
            ring._mm[off : off + spec.num_readers] = b"\x01" * spec.num_readers
        return ring

    @classmethod
    def attach(cls, spec: RingSpec, index: int) -> ShmRing:
        if not 0 <= index < spec.num_readers:
            raise ValueError(f"reader index {index} outside [0, {spec.num_readers})")
        ring = cls(spec, index, os.open(spec.path, os.O_RDWR))
        _Q.pack_into(ring._mm, 8 * (1 + index), os.getpid())
        return ring

    def _slot(self, slot: int) -> int:
        return self.spec.header_bytes + slot * self.spec.slot_stride

    def _pid(self, who: int | None) -> int:
        """The writer's pid (None) or reader ``who``'s (0 until it attached)."""
        return _Q.unpack_from(self._mm, 0 if who is None else 8 * (1 + who))[0]

    # ---- the writer ----------------------------------------------------------------------------------------
    def write(self, payload: bytes, timeout_s: float, overflow: Callable[[bytes], None] | None = None) -> None:
        """Publish ``payload`` to every reader; a payload over ``slot_bytes`` goes through ``overflow(payload)``
        (called after the announcement, on every reader's matching ``overflow_recv``)."""
        if self.reader is not None:
            raise RuntimeError("write: this end of the ring is a reader")
        n = len(payload)
        if n > self.spec.slot_bytes and overflow is None:
            raise ValueError(f"message of {n} bytes exceeds the ring's {self.spec.slot_bytes}-byte slots and no "
                             f"overflow channel is set")
        seq = self._seq + 1
        off = self._slot((seq - 1) % self.spec.num_slots)
        flags = slice(off + 16, off + 16 + self.spec.num_readers)
        full = b"\x01" * self.spec.num_readers
        self._wait(lambda: self._mm[flags] == full, timeout_s, lambda: self._slow_readers(flags))
        inline = n <= self.spec.slot_bytes
        if inline:
            data = off + self.spec.slot_header_bytes
            self._mm[data : data + n] = payload
        _Q.pack_into(self._mm, off + 8, n if inline else -n)
        self._mm[flags] = b"\x00" * self.spec.num_readers
        _Q.pack_into(self._mm, off, seq)  # publish last
        self._seq = seq
        if not inline:
            overflow(bytes(payload))

    def _slow_readers(self, flags: slice) -> str:
        """Why the readers that have not read the slot's last message are late ("" while they may still)."""
        pending = [i for i, f in enumerate(self._mm[flags]) if not f]
        dead = [(i, self._pid(i)) for i in pending if self._pid(i) and not process_alive(self._pid(i))]
        if dead:
            return "; ".join(f"broadcast reader {i} (pid {pid}) has exited" for i, pid in dead)
        return ""

    # ---- a reader ------------------------------------------------------------------------------------------
    def read(self, timeout_s: float | None = None, overflow_recv: Callable[[int], bytes] | None = None) -> bytes:
        """The next message (waits for it; ``timeout_s`` None: as long as the writer lives)."""
        if self.reader is None:
            raise RuntimeError("read: this end of the ring is the writer")
        seq = self._seq + 1
        off = self._slot((seq - 1) % self.spec.num_slots)
        self._wait(lambda: _Q.unpack_from(self._mm, off)[0] == seq, timeout_s, self._writer_gone)
        n = _Q.unpack_from(self._mm, off + 8)[0]
        if n >= 0:
            data = off + self.spec.slot_header_bytes
            payload = bytes(self._mm[data : data + n])
        self._mm[off + 16 + self.reader] = 1
        self._seq = seq
        if n < 0:
            if overflow_recv is None:
                raise BroadcastError(f"message {seq} of {-n} bytes went by the overflow channel, which this reader "
                                     f"does not have")
            payload = overflow_recv(-n)
        return payload

    def _writer_gone(self) -> str:
        pid = self._pid(None)
        return "" if process_alive(pid) else f"the broadcast writer (pid {pid}) has exited"

    # ---- both ----------------------------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], timeout_s: float | None, why_stuck: Callable[[], str]) -> None:
        start = last_check = time.monotonic()
        sleep = 10e-6
        while not ready():
            now = time.monotonic()
            if now - start < self.spin_s:
                os.sched_yield()
                continue
            if now - last_check > _CHECK_S:
                last_check = now
                why = why_stuck()
                if why:
                    raise BroadcastError(why)
                if timeout_s is not None and now - start > timeout_s:
                    side = "readers did not take" if self.reader is None else "writer did not send"
                    raise BroadcastError(f"the broadcast ring's {side} message {self._seq + 1} within "
                                         f"{timeout_s:.1f} s")
            time.sleep(sleep)
            sleep = min(_MAX_SLEEP_S, sleep * 2)

    def close(self, unlink: bool = False, keep_mapping: bool = False) -> None:
        """Unmap (unless ``keep_mapping``) and, with ``unlink``, remove the file (the writer, once the readers
        have mapped it or at the end)."""
        if not keep_mapping and not self._mm.closed:
            self._mm.close()
        if unlink:
            try:
                os.unlink(self.spec.path)
            except FileNotFoundError:
                pass
