"""The multi-process executor: one worker process per rank over torch.distributed (one per GPU, or per CPU rank).

The driver (the engine core's process) spawns this node's ranks and talks to global rank 0 through a pipe. Each
command (info, cache_budget, init_cache, execute, shutdown) goes from rank 0 to every rank through a
:class:`~rocm_k3.executor.step_channel.StepChannel` (a shared-memory ring on one node, tensor frames over the gloo
world group across nodes; no pickled object collective on the step path), so all ranks run the same step in the
same order and issue the same collectives. After a command every rank adds its error flag to one all-reduce (the
messages are gathered only when a flag is set, so a failure anywhere is named); the sampling rank (TP rank 0 of the
last stage) sends its StepOutput to rank 0 point to point (nothing to send when it is rank 0). Nodes other than 0 run headless (:func:`run_headless`): their ranks join the same
group over TCP (``--master-addr`` / ``--master-port``) and follow rank 0's broadcasts.

Pipeline parallelism on one node: ``pipeline_depth`` = the number of stages. The driver then
:meth:`~MultiprocExecutor.submit` s up to that many steps before it :meth:`~MultiprocExecutor.collect` s the oldest
one's output: every rank runs an ``execute`` without the error all-reduce (which would hold the first stage until
the last one finished), the sampling rank sends its StepOutput straight to the driver through its own report pipe,
and a rank that fails names itself there. So the first stage runs step N + 1 while the last one still runs step N
(the hidden states go stage to stage with asynchronous point-to-point sends, see
:class:`~rocm_k3.worker.stage_link.StageLink`). Several nodes keep one step in flight.

Idle ranks live as long as the server: while no command comes, rank 0 broadcasts a ``ping`` every
``idle_ping_s(timeout_s)`` seconds, so the other ranks' waits (collectives bounded by ``timeout_s``) never expire;
``timeout_s`` guards the collectives of a step, not the wait for work. On one node the group meets through a
:class:`~torch.distributed.FileStore` in a private temporary folder and gloo binds to the loopback interface, so no
socket of the ranks listens beyond 127.0.0.1 (several nodes meet at ``--master-addr:--master-port``).

No hang: the driver watches its ranks' processes while it waits (and :meth:`MultiprocExecutor.check_alive` between
steps); a rank that dies ends the whole group with
:class:`WorkerDiedError` naming it, a rank that raises ends it with :class:`WorkerError` naming it, and a step that
takes longer than ``timeout_s`` (a collective stuck on a lost remote rank) ends it with :class:`WorkerTimeoutError`.
"""

from __future__ import annotations

import ast
import collections
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

from rocm_k3.cache.geometry import CacheGeometry
from rocm_k3.distributed.context import ParallelConfig
from rocm_k3.distributed.shm_broadcast import SPIN_S, BroadcastError
from rocm_k3.executor.step_channel import StepChannel, new_ring_path, recv_bytes, send_bytes
from rocm_k3.worker.step_io import StepInput, StepOutput
from rocm_k3.worker.worker import WorkerConfig, WorkerInfo

_POLL_S = 0.2
GPU_SPIN_S = 0.05


def idle_ping_s(timeout_s: float) -> float:
    """How often rank 0 pings idle ranks: a third of the collective timeout, between 0.5 s and 30 s."""
    return min(30.0, max(0.5, timeout_s / 3))


class WorkerError(RuntimeError):
    """A rank raised; the message names the rank and carries its error."""


class WorkerDiedError(WorkerError):
    """A rank's process ended unexpectedly (killed, crashed)."""


class WorkerTimeoutError(WorkerError):
    """No answer from the ranks within the timeout (e.g. a collective waiting on a lost rank)."""


def _rank_main(rank: int, config: WorkerConfig, conn, store_file: str | None = None,
               ring_path: str | None = None, report=None) -> None:
    """One rank: join the group, load this rank's shard, then follow rank 0's commands until shutdown.
    ``store_file``: the FileStore the ranks of a one-node group meet in (None: env:// at master_addr:port);
    ``ring_path``: the shared-memory ring of a one-node group's step channel (None: tensor frames);
    ``report``: this rank's pipe to the driver for pipelined steps (outputs, errors), None without pipelining."""
    import torch.distributed as dist

    from rocm_k3.distributed.groups import destroy_parallel, init_parallel, rank_env
    from rocm_k3.worker.worker import Worker

    par = config.parallel
    try:
        cfg = config.for_rank(rank)
        ctx = init_parallel(par, rank_env(par, rank), cfg.device.type, store_file=store_file)
        worker = Worker(cfg, ctx=ctx)
    except BaseException as exc:  # report a failed start to the driver (rank 0) or just exit non-zero
        if conn is not None:
            conn.send(("error", f"rank {rank} failed to start: {type(exc).__name__}: {exc}"))
        raise
    group = ctx.world_cpu_group
    # GPU ranks have cores to spare: spin up to 50 ms for the next command (a sleep's wake-up would add to each
    # step); CPU ranks share their cores with the work, so they spin briefly, then sleep
    spin_s = GPU_SPIN_S if cfg.device.type == "cuda" else SPIN_S
    channel = StepChannel.open(rank, par.world_size, group, ring_path, par.timeout_s, spin_s)
    status = _gather_status(dist, group, rank, None)  # also: the ring file exists from here on
    channel.attach(ring_path, par.world_size)
    dist.barrier(group=group)  # every reader has mapped the ring: its file can go (no tmpfs left behind a kill)
    channel.unlink()
    if conn is not None:
        conn.send(("ready", status))
    ping_s = idle_ping_s(par.timeout_s)
    while True:
        try:
            if rank == 0:
                name, args = command = _next_command(conn, ping_s)
                channel.send(command)
            else:
                name, args = channel.recv()
        except BroadcastError as exc:  # a peer's process ended: end this rank (the driver names the dead one)
            if conn is not None:
                conn.send(("error", f"rank {rank}: {exc}"))
            break
        if name == "shutdown":
            break
        if name == "ping":
            continue
        result, error = None, None
        try:
            result = _run(worker, name, args)
        except BaseException as exc:
            error = f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        if name == "execute" and report is not None:  # pipelined: no collective, so this stage runs on
            if error is not None:
                report.send(("error", error))  # the driver ends the group
            elif ctx.is_sampling_rank:
                report.send(("step", result))
            continue
        errors = _step_errors(dist, group, rank, error)
        if not errors and name == "execute" and ctx.sampling_rank != 0:  # the output, from the sampling rank only
            if ctx.is_sampling_rank:
                send_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), 0, group)
            elif rank == 0:
                result = pickle.loads(recv_bytes(ctx.sampling_rank, group))
        if not errors and name == "execute_replicas":  # data parallelism: each stepping replica's output
            result = _replica_outputs(par, rank, args[0], result, group)
        if not errors and name == "cache_budget" and result is not None:
            result = _min_over_ranks(dist, group, result)
        if not errors and name == "rank_stats":
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, result, group=group)
            result = everyone
        if rank == 0:
            conn.send(("error", "; ".join(errors)) if errors else ("ok", result))
    channel.close()
    destroy_parallel()


def _refuse_unguarded_main() -> None:
    """Spawned ranks re-import the user's script: one that builds a parallel LLM outside an
    ``if __name__ == "__main__":`` block would build it again in every rank. Name the guard before spawning."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or not path or not os.path.isfile(path):
        return  # not reached from a script's top level (a function of an imported module, a REPL, pytest)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    line = frame.f_lineno
    for node in ast.walk(tree):
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)} if isinstance(node, ast.If) else set()
        if "__name__" in names:
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                return
    raise RuntimeError(f"{path}:{line} creates a parallel LLM (several ranks) at the script's top level; its worker "
                       f"processes are spawned and re-import the script: put that code under "
                       f"`if __name__ == \"__main__\":`")


def _next_command(conn, ping_s: float) -> tuple[str, tuple]:
    """Rank 0: the driver's next command, or a ``ping`` for the other ranks when none came within ``ping_s``."""
    if conn.poll(ping_s):
        try:
            return conn.recv()
        except EOFError:  # the driver is gone: end the group
            return ("shutdown", ())
    return ("ping", ())


def _run(worker, name: str, args: tuple) -> Any:
    if name == "info":
        return worker.info()
    if name == "cache_budget":
        return worker.cache_budget(*args)
    if name == "init_cache":
        return worker.init_cache(*args)
    if name == "execute":
        return worker.execute(*args)
    if name == "execute_replicas":
        return worker.execute_replicas(*args)
    if name == "rank_stats":
        return worker.rank_stats(*args)
    raise ValueError(f"unknown worker command {name!r}")


def _replica_outputs(par: ParallelConfig, rank: int, steps: tuple, result: Any, group) -> list[Any] | None:
    """Data parallelism, after a step: rank 0 gets one StepOutput per replica (None where the replica sat out),
    each sent point to point by its replica's sampling rank; the other ranks return None."""
    outputs: list[Any] = []
    for replica, step in enumerate(steps):
        src = par.replica_sampling_rank(replica)
        if step is None or src == 0:
            outputs.append(result if step is not None and rank == 0 else None)
        elif rank == src:
            send_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), 0, group)
        elif rank == 0:
            outputs.append(pickle.loads(recv_bytes(src, group)))
    return outputs if rank == 0 else None


def _step_errors(dist, group, rank: int, error: str | None) -> list[str]:
    """After a command: one all-reduce of the ranks' error flags; the messages are gathered only when one is set."""
    import torch

    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return _gather_status(dist, group, rank, error) if int(flag) else []


def _gather_status(dist, group, rank: int, error: str | None) -> list[str]:
    """Every rank's error (or None), collected on all ranks; returns the errors."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, error, group=group)
    return [e for e in everyone if e]


def _min_over_ranks(dist, group, budget: tuple[int, int]) -> tuple[int, int]:
    import torch

    t = torch.tensor(budget, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0]), int(t[1])


class MultiprocExecutor:
    """See the module docstring. ``config.parallel`` gives the layout; this process is node 0's driver."""

    def __init__(self, config: WorkerConfig) -> None:
        _refuse_unguarded_main()
        par = config.parallel
        if par.node_rank != 0:
            raise ValueError("MultiprocExecutor runs on node 0; nodes > 0 run rocm_k3.executor.multiproc.run_headless")
        self.config = config
        self.timeout_s = par.timeout_s
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._procs = []
        # one node: the ranks meet in a private FileStore (no TCP store listening on every interface)
        self._store_dir = tempfile.mkdtemp(prefix="rocm-k3-group-") if par.nnodes == 1 else None
        store_file = os.path.join(self._store_dir, "store") if self._store_dir else None
        # one node: the step channel's shared-memory ring file (tmpfs where there is one; rank 0 unlinks it at start)
        self._ring_path = ring_path = new_ring_path() if par.nnodes == 1 else None
        # pipelined steps on one node (see the module docstring): a report pipe per rank
        self.pipeline_depth = par.pipeline_parallel_size if par.nnodes == 1 else 1
        self._reports: list = []
        self._outputs: collections.deque[StepOutput] = collections.deque()
        self._pending = 0  # steps submitted and not collected
        for rank in par.node_ranks():
            report = None
            if self.pipeline_depth > 1:
                mine, report = ctx.Pipe(duplex=False)
                self._reports.append(mine)
            proc = ctx.Process(target=_rank_main,
                               args=(rank, config, child if rank == 0 else None, store_file, ring_path, report),
                               name=f"rocm-k3-rank{rank}", daemon=True)
            proc.start()
            if report is not None:  # the rank holds the send end; closing ours lets its EOF show when it ends
                report.close()
            self._procs.append((rank, proc))
        self._closed = False
        self._wait("ready", startup=True)

    # ---- the executor interface ----------------------------------------------------------------------------
    # info, the cache budget (a profiling forward) and the cache's allocation run once, at start: they wait as long as
    # the start does, not a step's timeout_s (a TP-2 server at --distributed-timeout 5 on two loaded cores timed out
    # in its profiling forward, session 30's CI)
    def info(self) -> WorkerInfo:
        return self._call("info", startup=True)

    def cache_budget(self, block_size: int) -> tuple[int, int] | None:
        return self._call("cache_budget", block_size, startup=True)

    def init_cache(self, geometry: CacheGeometry) -> None:
        self._call("init_cache", geometry, startup=True)

    def execute(self, step: StepInput) -> StepOutput:
        if self.config.parallel.data_parallel_size > 1:
            raise ValueError("execute: with data_parallel_size > 1 every replica steps at once: use "
                             "execute_replicas (one step per replica)")
        if self.pipeline_depth == 1:
            return self._call("execute", step)
        self.submit(step)
        while True:
            out = self.collect()
            if out.step_id == step.step_id:
                return out

    def submit(self, step: StepInput) -> None:
        """Pipelined (``pipeline_depth`` > 1): start ``step`` on the ranks without waiting for it."""
        if self.pipeline_depth == 1:
            raise RuntimeError("submit: this executor runs one step at a time (execute)")
        if self._closed:
            raise WorkerError("the worker group has shut down (an earlier error ended it)")
        self._pending += 1  # before the send: an interrupt after it must not leave an output uncounted
        try:
            self._conn.send(("execute", (step,)))
        except OSError:  # rank 0 is gone: wait until its process's end names it (WorkerDiedError)
            self._pending -= 1
            while True:
                self._wait("step")

    def collect(self) -> StepOutput:
        """The output of the oldest submitted step (outputs come in submission order)."""
        if self._pending == 0:
            raise RuntimeError("collect: no step was submitted")
        while not self._outputs:
            self._wait("step")
        self._pending -= 1
        return self._outputs.popleft()

    def execute_replicas(self, steps: tuple[StepInput | None, ...]) -> list[StepOutput | None]:
        """Data parallelism: one step per replica (None: the replica sits out, its ranks run the idle step), all
        ranks in lockstep; the outputs in replica order (None where the replica sat out)."""
        return self._call("execute_replicas", tuple(steps))

    def rank_stats(self, reset: bool = False) -> list[dict]:
        """Per rank (in rank order): bytes it loaded and the collectives it issued since the last reset."""
        return self._call("rank_stats", reset)

    def check_alive(self) -> None:
        """Between steps: raise :class:`WorkerDiedError` (and end the group) if a rank's process has ended."""
        if self._closed:
            raise WorkerError("the worker group has shut down (an earlier error ended it)")
        for rank, proc in self._procs:
            if not proc.is_alive():
                self._fail(WorkerDiedError(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"))

    def shutdown(self) -> None:
        if self._closed:
            self._remove_store()
            return
        self._closed = True
        try:
            if all(p.is_alive() for _, p in self._procs):
                self._conn.send(("shutdown", ()))
        except (BrokenPipeError, OSError):
            pass
        deadline = time.monotonic() + 10
        for _, proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        self._kill_all()
        self._remove_store()

    def _remove_store(self) -> None:
        if getattr(self, "_store_dir", None):
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None
        if getattr(self, "_ring_path", None):  # rank 0 removes it at start; not when the group failed before
            try:
                os.unlink(self._ring_path)
            except FileNotFoundError:
                pass
            self._ring_path = None

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # ---- plumbing ------------------------------------------------------------------------------------------
    def _call(self, name: str, *args: Any, startup: bool = False) -> Any:
        if self._closed:
            raise WorkerError("the worker group has shut down (an earlier error ended it)")
        self._conn.send((name, args))
        return self._wait("ok", startup)

    def _wait(self, expected: str, startup: bool = False) -> Any:
        """Wait for rank 0's reply while watching every local rank; on any failure end the whole group."""
        deadline = time.monotonic() + (max(self.timeout_s, 600.0) if startup else self.timeout_s)
        sentinels = {proc.sentinel: (rank, proc) for rank, proc in self._procs}
        while True:
            ready = mpc.wait([self._conn, *self._reports, *sentinels], timeout=_POLL_S)
            for conn in [c for c in (self._conn, *self._reports) if c in ready]:
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):  # its rank ended: named below by its sentinel
                    kind, payload = "died", None
                    if conn is not self._conn:
                        self._reports.remove(conn)
                if kind == "step":  # a pipelined step's output (from the sampling rank's report pipe)
                    self._outputs.append(payload)
                    if expected == "step":
                        return None
                elif kind == expected:
                    return payload
                elif kind == "error":
                    self._fail(self._dead_first(WorkerError(payload)))
            for sentinel in ready:
                if sentinel in sentinels:
                    rank, proc = sentinels[sentinel]
                    proc.join(0.1)
                    self._fail(WorkerDiedError(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"))
            if time.monotonic() > deadline:
                self._fail(WorkerTimeoutError(f"no answer from the ranks within {self.timeout_s:.0f} s"))

    def _dead_first(self, error: WorkerError) -> WorkerError:
        """A rank's error may follow another rank's end (its point-to-point lost the peer, with no collective to
        stop it first under pipelining): name the rank that ended, if one did within a second."""
        ready = mpc.wait([proc.sentinel for _, proc in self._procs], timeout=1.0)
        for rank, proc in self._procs:
            if proc.sentinel in ready:
                proc.join(0.1)
                return WorkerDiedError(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; then {error}")
        return error

    def _fail(self, error: WorkerError) -> None:
        self._closed = True
        self._kill_all()
        self._remove_store()
        raise error

    def _kill_all(self) -> None:
        for _, proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for _, proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def run_headless(config: WorkerConfig) -> int:
    """Node ``node_rank > 0``: run this node's ranks until rank 0 shuts the group down; exit code 0 if all ranks
    ended cleanly, else the first non-zero code (a lost group ends the ranks through their collectives)."""
    par: ParallelConfig = config.parallel
    if par.node_rank == 0:
        raise ValueError("run_headless is for nodes > 0; node 0 runs the engine (MultiprocExecutor)")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, config, None), name=f"rocm-k3-rank{rank}")
             for rank in par.node_ranks()]
    for proc in procs:
        proc.start()
    code = 0
    for proc in procs:
        proc.join()
        if proc.exitcode and not code:
            code = proc.exitcode
    return code

