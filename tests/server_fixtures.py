"""Test support: a real ``rocm-k3`` server (uvicorn on 127.0.0.1, a free port, in a background thread) over an
engine the test builds, and the OpenAI clients that talk to it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.engine.async_llm import AsyncLLM
from rocm_k3.engine.assembly import assemble_engine
from rocm_k3.entrypoints.openai.api_server import build_app, served_model

ROOT = Path(__file__).resolve().parents[1]


class RunningServer:
    """A server on 127.0.0.1:``port``; ``served`` is what its handlers see (engine, frontend, metrics)."""

    def __init__(self, served, server: uvicorn.Server, thread: threading.Thread) -> None:
        self.served = served
        self.engine: AsyncLLM | None = served.engine if served is not None else None
        self._server = server
        self._thread = thread
        sockets = server.servers[0].sockets
        self.port = sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def url(self, route: str) -> str:
        return self.base_url + route

    def client(self, api_key: str = "unused", timeout: float = 120, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout, **kw)

    def async_client(self, api_key: str = "unused", timeout: float = 120, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout,
                                  **kw)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


@contextlib.contextmanager
def running_server(engine_args: EngineArgs, server_args: ServerArgs | None = None, *,
                   core_hook=None) -> Iterator[RunningServer]:
    """Build the engine, serve it on a free port, yield the server; stop both at the end. ``core_hook(core)`` may
    change the engine core before it starts (e.g. inject failures)."""
    server_args = server_args or ServerArgs(port=0, uvicorn_log_level="warning")
    assembled = assemble_engine(engine_args)
    if core_hook is not None:
        core_hook(assembled.core)
    engine = AsyncLLM(assembled.core)
    served = served_model(engine, assembled, server_args)
    running = start_app(build_app(served), server_args.resolved_uvicorn_log_level, served)
    try:
        yield running
    finally:
        running.stop()
        engine.shutdown()


def serve_module(engine_args: EngineArgs, **server_kwargs) -> Iterator[RunningServer]:
    """The body of a module-scoped server fixture: ``yield from serve_module(ENGINE, enable_auto_tool_choice=True)``
    (ServerArgs on a free port, uvicorn warnings only, plus ``server_kwargs``)."""
    with running_server(engine_args, ServerArgs(port=0, uvicorn_log_level="warning", **server_kwargs)) as srv:
        yield srv


def start_app(app, log_level: str = "warning", served=None) -> RunningServer:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a background thread; the caller stops it."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level=log_level, timeout_graceful_shutdown=2,
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(served, server, thread)


def spawn_serve(workdir, *flags: str, startup_s: float = 120) -> tuple[subprocess.Popen, int, Path]:
    """Start ``python -m rocm_k3.cli serve --port 0 FLAGS`` as a user would (cwd and log in ``workdir``); returns
    (process, port, log path) once uvicorn reports its port. The caller stops the process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = Path(workdir) / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rocm_k3.cli", "serve", "--port", "0", *flags],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"rocm-k3 serve did not start:\n{log.read_text()[-4000:]}")
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log.read_text())
        if match:
            return proc, int(match.group(1)), log
        time.sleep(0.2)


@contextlib.contextmanager
def serve_subprocess(workdir, *flags: str, startup_s: float = 120) -> Iterator[tuple[int, subprocess.Popen]]:
    """:func:`spawn_serve`, yielding (port, process); stops it with Ctrl-C and checks it exits with status 0."""
    proc, port, log = spawn_serve(workdir, *flags, startup_s=startup_s)
    try:
        yield port, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    if code != 0:
        raise RuntimeError(f"rocm-k3 serve exited with status {code}:\n{log.read_text()[-4000:]}")
