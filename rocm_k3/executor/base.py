"""The executor interface the engine core drives (no tensors cross it: only step-contract dataclasses)."""

from __future__ import annotations

from typing import Protocol

from rocm_k3.cache.geometry import CacheGeometry
from rocm_k3.worker.step_io import StepInput, StepOutput


class Executor(Protocol):
    """Runs steps on one or more workers.

    info():                      model facts (vocab_size, max_position_embeddings, eos ids, cache bytes).
    cache_budget(block_size):    (kv_cache_bytes, state_cache_bytes) measured on the device, or None (use configured).
    init_cache(geometry):        allocate the pools and block tables the planned CacheGeometry gives (and capture
                                 decode graphs).
    execute(step):               run one step; the sampling rank's output.
    shutdown():                  release the workers (idempotent).
    """

    def info(self): ...

    def cache_budget(self, block_size: int) -> tuple[int, int] | None: ...

    def init_cache(self, geometry: CacheGeometry) -> None: ...

    def execute(self, step: StepInput) -> StepOutput: ...

    def shutdown(self) -> None: ...
