"""The in-process executor: one :class:`~rocm_k3.worker.worker.Worker` in this process (``LLM`` and the tests)."""

from __future__ import annotations

from rocm_k3.cache.geometry import CacheGeometry
from rocm_k3.worker.step_io import StepInput, StepOutput
from rocm_k3.worker.worker import Worker, WorkerConfig, WorkerInfo


class UniprocExecutor:
    """See :class:`rocm_k3.executor.base.Executor`. ``model`` / ``vision_model``: already loaded models to serve
    (tests)."""

    def __init__(self, config: WorkerConfig, model=None, vision_model=None) -> None:
        self.worker = Worker(config, model=model, vision_model=vision_model)

    def info(self) -> WorkerInfo:
        return self.worker.info()

    def cache_budget(self, block_size: int) -> tuple[int, int] | None:
        return self.worker.cache_budget(block_size)

    def init_cache(self, geometry: CacheGeometry) -> None:
        self.worker.init_cache(geometry)

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    # asynchronous scheduling (EngineConfig.async_scheduling): the engine keeps two steps in flight
    supports_async_scheduling = True

    def submit(self, step: StepInput) -> None:
        """Launch ``step`` on the device (no read back): the next one may be submitted before this one's
        :meth:`collect`."""
        self.worker.launch(step)

    def collect(self) -> StepOutput:
        """The oldest submitted step's output."""
        return self.worker.finish()

    def rank_stats(self, reset: bool = False) -> list[dict]:
        return [self.worker.rank_stats(reset)]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker = None
