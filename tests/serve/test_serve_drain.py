"""SIGTERM drains the server (issue 31, item 2): 64 streams in flight, SIGTERM in the middle.

Every stream ends with either its full tokens or an error event, and always with ``data: [DONE]``; requests sent
after the signal get 503 with ``Retry-After``; the process exits 0 (the same with ``-tp 2``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server_fixtures import spawn_serve

STREAMS = 64
MAX_TOKENS = 64


def _start(workdir: Path, *flags: str) -> tuple[subprocess.Popen, int, Path]:
    return spawn_serve(workdir, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", str(STREAMS),
                       *flags, startup_s=240)


def _stream(port: int, i: int, results: dict, started: set) -> None:
    body = json.dumps({"prompt": f"Story {i}:", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    events = []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.add(i)
        results[i] = events
    except urllib.error.HTTPError as err:
        results[i] = ("http", err.code)
    except OSError as err:
        results[i] = ("broken", repr(err))


def _verdict(events) -> str:
    """'full' (all MAX_TOKENS, finish_reason length), 'error' (an error event), else what went wrong."""
    if not isinstance(events, list):
        return f"not a stream: {events}"
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] at the end: {events[-3:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return "error"
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    return "full" if "length" in finish else f"cut without an error: {finish[-3:]}"


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "grace", "flags"),
                         [(1, 120, ()), (1, 120, ("--async-scheduling",)),
                          pytest.param(2, 1, (), marks=pytest.mark.dist)],
                         ids=["tp1-drains-all", "tp1-async-drains-all", "tp2-cuts-at-the-timeout"])
def test_sigterm_mid_load_ends_every_stream_and_exits_0(tmp_path, tp, grace, flags) -> None:
    """tp1: a grace long enough for every stream (all finish in full), also with asynchronous scheduling (two steps
    in flight when the signal lands); tp2: 1 s (the rest end with an error)."""
    proc, port, log = _start(tmp_path, "-tp", str(tp), "--shutdown-timeout", str(grace), *flags)
    try:
        results: dict = {}
        started: set = set()
        threads = [threading.Thread(target=_stream, args=(port, i, results, started)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60  # SIGTERM once tokens flow on most streams
        while len(started) < STREAMS // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", data=b'{"prompt": "late", "max_tokens": 2}',
                headers={"Content-Type": "application/json"}), timeout=30)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"]
        for t in threads:
            t.join(120)
        code = proc.wait(60)
        text = log.read_text()
        verdicts = [_verdict(results.get(i)) for i in range(STREAMS)]
        bad = [v for v in verdicts if v not in ("full", "error")]
        assert not bad, f"{len(bad)} streams ended badly, e.g. {bad[:3]}\n{text[-2000:]}"
        assert code == 0, f"exit status {code}:\n{text[-3000:]}"
        assert "Traceback" not in text, text[-3000:]
        if grace >= 120:
            assert verdicts == ["full"] * STREAMS, "a long grace lets every running request finish"
        else:
            assert "shutdown timeout" in text or verdicts == ["full"] * STREAMS
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
