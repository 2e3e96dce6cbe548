"""The step channel's shared-memory ring (rocm_k3/distributed/shm_broadcast.py) with real processes: messages in
order through a ring that wraps many times, a slow reader holding the writer back, messages over a slot's size
overflowing to a gloo broadcast, and no hang when a peer is gone: a dead reader is named by the writer, a stuck
one ends the write at the timeout, and a reader whose writer died stops waiting."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from rocm_k3.distributed.shm_broadcast import BroadcastError, RingSpec, ShmRing

SLOTS, SLOT_BYTES, DELAY_S = 3, 64, 0.02
MESSAGES = [bytes([i % 251]) * ((i * 37) % 200) for i in range(40)]  # 0-199 bytes: a third overflow the slots


def _gloo_end(rank: int, store: str, spec: RingSpec, out) -> None:
    """Rank 0 writes MESSAGES; ranks 1 and 2 read them (rank 2 slowly); the overflow is a gloo broadcast."""
    import torch.distributed as dist

    from rocm_k3.executor.step_channel import _broadcast_raw

    dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
    try:
        if rank == 0:
            ring = ShmRing.create(spec)
            dist.barrier()
            start = time.monotonic()
            for m in MESSAGES:
                ring.write(m, 60.0, lambda big: _broadcast_raw(big, len(big), None))
            out.put((0, time.monotonic() - start))
        else:
            dist.barrier()
            ring = ShmRing.attach(spec, rank - 1)
            got = []
            for _ in MESSAGES:
                got.append(ring.read(60.0, lambda n: _broadcast_raw(None, n, None)))
                if rank == 2:
                    time.sleep(DELAY_S)
            out.put((rank, got))
        dist.barrier()
        ring.close(unlink=rank == 0)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_ring_wraps_overflows_and_waits_for_a_slow_reader(tmp_path) -> None:
    spec = RingSpec(str(tmp_path / "ring"), num_readers=2, num_slots=SLOTS, slot_bytes=SLOT_BYTES)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_end, args=(r, str(tmp_path / "store"), spec, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
    assert got[1] == MESSAGES and got[2] == MESSAGES
    assert sum(len(m) > SLOT_BYTES for m in MESSAGES) >= 10
    # the writer ran at the slow reader's pace: at most SLOTS messages ahead of it
    assert got[0] >= (len(MESSAGES) - SLOTS - 1) * DELAY_S, got[0]
    assert not (tmp_path / "ring").exists()


def _reader(path: str, spec: RingSpec, reads: int, then: str) -> None:
    ring = ShmRing.attach(spec, 0)
    for _ in range(reads):
        ring.read(30.0)
    if then == "die":
        os._exit(0)
    time.sleep(60)  # "stuck": alive, never reads again


def _start_reader(spec: RingSpec, reads: int, then: str) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=_reader, args=(spec.path, spec, reads, then))
    proc.start()
    return proc


def _fill_until_blocked(ring: ShmRing, timeout_s: float) -> None:
    for i in range(10):  # bounded: the reader took one message, so the ring blocks after SLOTS more
        ring.write(b"m%d" % i, timeout_s)


@pytest.mark.parametrize("then, timeout_s, error, within_s", [
    ("die", 60.0, r"reader 0 \(pid {pid}\) has exited", 5),  # found by the liveness check, long before the timeout
    ("stuck", 1.0, r"readers did not take message \d+ within 1.0 s", 10),  # alive but never reads again
])
def test_writer_ends_on_a_dead_or_stuck_reader(tmp_path, then, timeout_s, error, within_s) -> None:
    spec = RingSpec(str(tmp_path / "ring"), num_readers=1, num_slots=2, slot_bytes=16)
    ring = ShmRing.create(spec)
    proc = _start_reader(spec, 1, then)
    try:
        ring.write(b"first", 60.0)
        if then == "die":
            proc.join(60)  # it read one message and exited (a zombie until reaped counts as exited too)
        start = time.monotonic()
        with pytest.raises(BroadcastError, match=error.format(pid=proc.pid)):
            _fill_until_blocked(ring, timeout_s)
        assert time.monotonic() - start < within_s
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        ring.close(unlink=True)


def _writer(spec: RingSpec) -> None:
    ring = ShmRing.create(spec)
    ring.write(b"only", 30.0)
    time.sleep(0.5)


def test_reader_stops_waiting_when_the_writer_died(tmp_path) -> None:
    spec = RingSpec(str(tmp_path / "ring"), num_readers=1, num_slots=2, slot_bytes=16)
    proc = mp.get_context("spawn").Process(target=_writer, args=(spec,))
    proc.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(spec.path) and time.monotonic() < deadline:
        time.sleep(0.01)
    ring = ShmRing.attach(spec, 0)
    try:
        assert ring.read(30.0) == b"only"
        with pytest.raises(BroadcastError, match=r"writer \(pid \d+\) has exited"):
            ring.read(None)  # no timeout: only the writer's death ends the wait
    finally:
        proc.join(30)
        ring.close(unlink=True)


def test_ring_spec_and_oversize_without_overflow_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="num_slots"):
        RingSpec(str(tmp_path / "r"), num_readers=1, num_slots=0)
    ring = ShmRing.create(RingSpec(str(tmp_path / "r"), num_readers=1, num_slots=2, slot_bytes=8))
    try:
        with pytest.raises(ValueError, match="exceeds the ring's 8-byte slots"):
            ring.write(b"x" * 9, 1.0)
    finally:
        ring.close(unlink=True)
