"""EngineArgs: the one list of engine knobs, from which the LLM keyword arguments, the CLI flags of
``generate`` / ``serve`` and the per-concern configs (cache, engine, worker) are all derived.

Flag names follow vLLM (``--max-model-len``, ``--gpu-memory-utilization``, ``--enforce-eager``,
``--no-enable-prefix-caching`` ...). Values are validated where they become configs (CacheConfig, EngineConfig,
WorkerConfig each check their fields in ``__post_init__``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rocm_k3.settings import BACKEND_CHOICES

DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
MOE_ACT_QUANT_CHOICES = ("bf16", "mxfp8")


@dataclasses.dataclass
class EngineArgs:
    """Every knob of the engine (help texts are the CLI's).

    model: checkpoint directory; None = the embedded tiny K3 model.
    """

    model: str | None = dataclasses.field(default=None, metadata={"help": "checkpoint directory (default: the "
                                                                  "embedded tiny K3 model)"})
    dtype: str = dataclasses.field(default="auto", metadata={
        "help": "auto: bfloat16 on a GPU, float32 on the CPU", "choices": DTYPE_CHOICES})
    backend: str | None = dataclasses.field(default=None, metadata={
        "help": "op backend for every op (default: ROCM_K3_BACKEND or auto)", "choices": BACKEND_CHOICES})
    device: str | None = dataclasses.field(default=None, metadata={"help": "torch device (default: first GPU, else cpu)"})
    max_model_len: int | None = dataclasses.field(default=None, metadata={
        "help": "longest prompt + generation (default: what one request can hold, at most max_position_embeddings)"})
    moe_act_quant: str = dataclasses.field(default="bf16", metadata={
        "help": "routed-expert activations: bf16 (A16W4) or mxfp8 (A8W4)", "choices": MOE_ACT_QUANT_CHOICES})
    enable_prefix_caching: bool = dataclasses.field(default=True, metadata={
        "help": "KDA-aware prefix caching (outputs are identical either way)"})
    block_size: int = dataclasses.field(default=128, metadata={"help": "MLA KV page size in tokens"})
    match_unit: int = dataclasses.field(default=64, metadata={"help": "prefix-cache hash granularity in tokens"})
    alignment: int = dataclasses.field(default=256, metadata={"help": "prefill chunk grid in tokens (KDA saves)"})
    max_num_batched_tokens: int = dataclasses.field(default=2048, metadata={"help": "new tokens per engine step"})
    max_num_seqs: int = dataclasses.field(default=32, metadata={"help": "requests running at once"})
    gpu_memory_utilization: float = dataclasses.field(default=0.9, metadata={
        "help": "fraction of GPU memory for weights, activations and the cache (GPU only)"})
    kv_cache_bytes: int | None = dataclasses.field(default=None, metadata={
        "help": "MLA KV page budget in bytes (overrides gpu_memory_utilization sizing)"})
    state_cache_bytes: int | None = dataclasses.field(default=None, metadata={
        "help": "KDA state slot budget in bytes (overrides gpu_memory_utilization sizing)"})
    enforce_eager: bool = dataclasses.field(default=False, metadata={"help": "never capture decode graphs"})
    progress: bool = dataclasses.field(default=False, metadata={"help": "show a progress bar while loading"})
    tensor_parallel_size: int = dataclasses.field(default=1, metadata={
        "help": "tensor-parallel ranks (GPUs of one node; heads and expert intermediate dims must divide)",
        "aliases": ("-tp",)})
    pipeline_parallel_size: int = dataclasses.field(default=1, metadata={
        "help": "pipeline stages (contiguous layer ranges, usually one node each)", "aliases": ("-pp",)})
    enable_expert_parallel: bool = dataclasses.field(default=False, metadata={
        "help": "split the routed experts whole over the tensor-parallel ranks instead of per expert"})
    nnodes: int = dataclasses.field(default=1, metadata={"help": "nodes of the run (node 0 serves)"})
    node_rank: int = dataclasses.field(default=0, metadata={"help": "this node's rank (> 0 runs headless)"})
    master_addr: str = dataclasses.field(default="127.0.0.1", metadata={"help": "node 0's address for the "
                                                                         "process group"})
    master_port: int = dataclasses.field(default=29517, metadata={"help": "node 0's port for the process group"})
    distributed_timeout: float = dataclasses.field(default=300.0, metadata={
        "help": "seconds a step or collective may take before the run is ended with an error"})

    def parallel_config(self):
        from rocm_k3.distributed.context import ParallelConfig

        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              enable_expert_parallel=self.enable_expert_parallel, nnodes=self.nnodes,
                              node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port,
                              timeout_s=self.distributed_timeout)

    def validated(self) -> EngineArgs:
        """Type checks that no config covers (the configs built from these args check the rest)."""
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise TypeError(f"model: expected a path or None, got {type(self.model).__name__}")
        if self.dtype not in DTYPE_CHOICES and not _is_torch_dtype(self.dtype):
            raise ValueError(f"dtype: expected one of {DTYPE_CHOICES} or a torch dtype, got {self.dtype!r}")
        if self.backend is not None and self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend: expected one of {BACKEND_CHOICES} or None, got {self.backend!r}")
        if self.moe_act_quant not in MOE_ACT_QUANT_CHOICES:
            raise ValueError(f"moe_act_quant: expected one of {MOE_ACT_QUANT_CHOICES}, got {self.moe_act_quant!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "progress", "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a number in (0, 1], got {util!r}")
        return self

    # ---- the CLI -------------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
        """One ``--flag`` per field (``--no-enable-prefix-caching`` for the default-on bools)."""
        group = parser.add_argument_group("engine and cache")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            if f.type in ("bool", bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
                continue
            kind = {"int | None": int, "int": int, "float": float}.get(str(f.type), str)
            group.add_argument(flag, *meta.get("aliases", ()), type=kind, default=f.default, help=meta.get("help"),
                               choices=meta.get("choices"), dest=f.name)
        if "enable_prefix_caching" not in skip:  # the flag name older versions of rocm-k3 documented
            group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                               help=argparse.SUPPRESS)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        values: dict[str, Any] = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        return cls(**values).validated()


def _is_torch_dtype(value: object) -> bool:
    import torch

    return isinstance(value, torch.dtype)
