"""One data-parallel replica's view of the shared multi-process executor.

With ``data_parallel_size`` N every replica has its own :class:`~rocm_k3.engine.core.EngineCore` (scheduler and
cache), but all N x TP ranks live in one :class:`~rocm_k3.executor.multiproc.MultiprocExecutor` and step in lockstep
(their MoE layers share one expert-parallel group). :class:`ReplicaExecutor` is what a replica's core holds: a step
it runs alone goes to every rank with the other replicas sitting out (their ranks run the idle step), which is
correct but serial; :class:`~rocm_k3.engine.dp_engine.DataParallelEngine` steps all replicas at once instead.
"""

from __future__ import annotations

from typing import Any

from rocm_k3.worker.step_io import StepInput, StepOutput


class ReplicaExecutor:
    """``executor``'s replica ``replica`` of ``replicas`` (see the module docstring)."""

    def __init__(self, executor: Any, replica: int, replicas: int) -> None:
        if not 0 <= replica < replicas:
            raise ValueError(f"replica: expected an int in [0, {replicas}), got {replica!r}")
        self.executor, self.replica, self.replicas = executor, replica, replicas

    def execute(self, step: StepInput) -> StepOutput:
        steps: list[StepInput | None] = [None] * self.replicas
        steps[self.replica] = step
        return self.executor.execute_replicas(tuple(steps))[self.replica]

    def check_alive(self) -> None:
        self.executor.check_alive()

    def rank_stats(self, reset: bool = False) -> list[dict]:
        """This replica's ranks' counters (``reset`` resets every rank's)."""
        return [r for r in self.executor.rank_stats(reset) if r["dp_rank"] == self.replica]

    def shutdown(self) -> None:
        self.executor.shutdown()
