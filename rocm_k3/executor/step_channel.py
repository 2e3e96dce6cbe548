"""How a command reaches every rank and a step's output reaches rank 0, without pickled object collectives.

- One node: rank 0 writes each command (pickled to bytes once) into a :class:`~rocm_k3.distributed.shm_broadcast.
  ShmRing` the other ranks read; a command larger than a slot overflows to one ``torch.distributed.broadcast`` of
  its bytes over the gloo world group.
- Several nodes: one broadcast of a fixed-size uint8 frame (length prefix + bytes) over the gloo world group, and a
  second broadcast of the rest when a command does not fit the frame.
- The step output: only the sampling rank has it; when that is not rank 0 it goes to rank 0 point to point, in the
  same frames (:func:`send_bytes` / :func:`recv_bytes`).
"""

from __future__ import annotations

import os
import pickle
import secrets
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from rocm_k3.distributed.shm_broadcast import SPIN_S, RingSpec, ShmRing

FRAME_BYTES = 64 * 1024  # one frame: an 8-byte length, then up to FRAME_BYTES - 8 bytes of the message


def new_ring_path() -> str:
    """A fresh path for a one-node ring file: on tmpfs (/dev/shm) when the machine has it, else in the temporary
    folder; a file, not a folder, so once rank 0 unlinks it after the ranks mapped it nothing is left behind
    (the file is created exclusively: a name that exists is an error, never reused)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"rocm-k3-ring-{os.getpid()}-{secrets.token_hex(8)}")


def _frame(payload: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the first frame, the rest as one tensor or None)."""
    n = len(payload)
    head = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    head[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
    first = payload[: FRAME_BYTES - 8]
    if first:
        head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    rest = payload[FRAME_BYTES - 8 :]
    return head, (torch.frombuffer(bytearray(rest), dtype=torch.uint8) if rest else None)


def _unframe(head: torch.Tensor, rest_of: Any) -> bytes:
    n = int.from_bytes(head[:8].numpy().tobytes(), "little")
    body = head[8 : 8 + min(n, FRAME_BYTES - 8)].numpy().tobytes()
    return body + (rest_of(n - (FRAME_BYTES - 8)) if n > FRAME_BYTES - 8 else b"")


def send_bytes(payload: bytes, dst: int, group) -> None:
    head, rest = _frame(payload)
    dist.send(head, dst, group=group)
    if rest is not None:
        dist.send(rest, dst, group=group)


def recv_bytes(src: int, group) -> bytes:
    head = torch.empty(FRAME_BYTES, dtype=torch.uint8)
    dist.recv(head, src, group=group)

    def rest_of(n: int) -> bytes:
        rest = torch.empty(n, dtype=torch.uint8)
        dist.recv(rest, src, group=group)
        return rest.numpy().tobytes()

    return _unframe(head, rest_of)


def _broadcast_raw(payload: bytes | None, n: int, group) -> bytes:
    """Broadcast ``n`` bytes from rank 0 (``payload`` there, None elsewhere)."""
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
           else torch.empty(n, dtype=torch.uint8))
    dist.broadcast(buf, 0, group=group)
    return payload if payload is not None else buf.numpy().tobytes()


class StepChannel:
    """Rank 0 :meth:`send` s each command to every rank; the others :meth:`recv` it (see the module docstring).
    ``ring``: this node's ring (one-node groups), or None (frames over ``group``)."""

    def __init__(self, rank: int, group, ring: ShmRing | None, timeout_s: float, spin_s: float = SPIN_S) -> None:
        self.rank = rank
        self.group = group
        self.ring = ring
        self.timeout_s = timeout_s
        self.spin_s = spin_s  # how long a ring end spins before it sleeps (see shm_broadcast)
        if ring is not None:
            ring.spin_s = spin_s

    @classmethod
    def open(cls, rank: int, world: int, group, ring_path: str | None, timeout_s: float,
             spin_s: float = SPIN_S) -> StepChannel:
        """Rank 0 creates the ring at ``ring_path`` (None: frames, several nodes); call :meth:`attach` on the
        other ranks after a barrier (the file exists then)."""
        ring = None
        if ring_path is not None and world > 1 and rank == 0:
            ring = ShmRing.create(RingSpec(ring_path, world - 1))
        return cls(rank, group, ring, timeout_s, spin_s)

    def attach(self, ring_path: str | None, world: int) -> None:
        if ring_path is not None and world > 1 and self.rank != 0:
            self.ring = ShmRing.attach(RingSpec(ring_path, world - 1), self.rank - 1)
            self.ring.spin_s = self.spin_s

    def send(self, command: Any) -> None:
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        if self.ring is not None:
            self.ring.write(payload, self.timeout_s, lambda big: _broadcast_raw(big, len(big), self.group))
            return
        head, rest = _frame(payload)
        dist.broadcast(head, 0, group=self.group)
        if rest is not None:
            dist.broadcast(rest, 0, group=self.group)

    def recv(self) -> Any:
        if self.ring is not None:
            return pickle.loads(self.ring.read(None, lambda n: _broadcast_raw(None, n, self.group)))
        head = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        dist.broadcast(head, 0, group=self.group)
        return pickle.loads(_unframe(head, lambda n: _broadcast_raw(None, n, self.group)))

    def unlink(self) -> None:
        """Rank 0: remove the ring's file once every rank has mapped it (the mappings stay valid)."""
        if self.ring is not None and self.rank == 0:
            self.ring.close(unlink=True, keep_mapping=True)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close(unlink=self.rank == 0)
