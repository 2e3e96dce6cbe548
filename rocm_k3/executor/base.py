"""The executor interface the engine core drives (no tensors cross it: only step-contract dataclasses)."""

from __future__ import annotations

from typing import Protocol

from rocm_k3.worker.step_io import StepInput, StepOutput


class Executor(Protocol):
    """Runs steps on one or more workers.

    info():                      model facts (vocab_size, max_position_embeddings, eos ids, cache bytes).
    cache_budget():              (kv_cache_bytes, state_cache_bytes) measured on the device, or None (use configured).
    init_cache(blocks, slots, max_model_len): allocate the pools (and capture decode graphs).
    execute(step):               run one step; the sampling rank's output.
    shutdown():                  release the workers (idempotent).
    """

    def info(self): ...

    def cache_budget(self) -> tuple[int, int] | None: ...

    def init_cache(self, num_blocks: int, num_slots: int, max_model_len: int) -> None: ...

    def execute(self, step: StepInput) -> StepOutput: ...

    def shutdown(self) -> None: ...
