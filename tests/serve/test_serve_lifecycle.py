"""A tensor-parallel server lives as long as it is needed, and no longer (issue 31, item 1).

``rocm-k3 serve -tp 2`` (gloo, two CPU ranks) with ``--distributed-timeout 5`` idles past four timeouts and still
answers; no socket of the server or of its ranks listens beyond loopback; a rank killed while idle turns
``/health`` 503 and ends the server with a non-zero status within 30 s (an orchestrator restarts it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server_fixtures import spawn_serve

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
LOOPBACK_V6 = "00000000000000000000000001000000"  # ::1


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += _children(p)
        except FileNotFoundError:
            pass
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            if m:
                inodes.add(m.group(1))
    except FileNotFoundError:
        pass
    return inodes


def listening_addresses(pids: list[int]) -> list[tuple[str, str]]:
    """(hex local address, port) of every TCP socket in LISTEN state owned by ``pids``."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                addr, port = local.split(":")
                found.append((addr, str(int(port, 16))))
    return found


def test_listening_addresses_reads_this_process(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        assert (LOOPBACK_V4, port) in listening_addresses([os.getpid()])
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = str(s.getsockname()[1])
        assert ("00000000", port) in listening_addresses([os.getpid()])  # what the real test would refuse


def _start(workdir: Path) -> tuple[subprocess.Popen, int, Path]:
    return spawn_serve(workdir, "--host", "127.0.0.1", "-tp", "2", "--distributed-timeout", "5", "--dtype", "float32",
                       "--max-model-len", "256", "--max-num-seqs", "4", startup_s=240)


def _complete(port: int) -> dict:
    body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _health(port: int, timeout: float) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_tp2_server_idles_past_the_timeout_binds_loopback_and_dies_loudly(tmp_path) -> None:
    proc, port, log = _start(tmp_path)
    try:
        first = _complete(port)["choices"][0]["text"]
        # the rank processes (multiprocessing's resource tracker, also a child, lingers a moment after the
        # server to unlink leaked semaphores: it is not a rank)
        ranks = [p for p in _tree(proc.pid) if p != proc.pid and b"spawn_main" in _cmdline(p)]
        assert len(ranks) == 2, [(p, _cmdline(p)) for p in _tree(proc.pid)]
        listening = listening_addresses(_tree(proc.pid))
        assert listening, "the server listens somewhere"
        wide = [(a, p) for a, p in listening if a not in (LOOPBACK_V4, LOOPBACK_V6)]
        assert not wide, f"sockets listening beyond loopback: {wide}"

        time.sleep(20)  # four collective timeouts of idleness
        assert _complete(port)["choices"][0]["text"] == first
        assert _health(port, 10) == 200

        victim = max(ranks)  # a rank process (the newest child), not the server
        os.kill(victim, signal.SIGKILL)
        saw_503, deadline = False, time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                saw_503 |= _health(port, 2) == 503
            except OSError:
                pass  # the server is going down
            time.sleep(0.1)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
        assert code not in (0, None), f"exit status {code}:\n{log.read_text()[-3000:]}"
        assert "exited with code" in log.read_text()  # the dead rank is named
        del saw_503  # the 503 window may be shorter than one poll; the exit status is the contract
        leftover = [p for p in ranks if Path(f"/proc/{p}").exists() and
                    "zombie" not in Path(f"/proc/{p}/status").read_text()]
        assert not leftover, f"rank processes left behind: {leftover}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
