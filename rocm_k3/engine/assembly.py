"""Engine assembly: the one place an :class:`~rocm_k3.args.EngineArgs` becomes a ready engine.

:func:`assemble_engine` resolves the device and dtype, finds the checkpoint (default: the embedded tiny K3 model),
its output format family, checks the parallel layout, starts the executor (one in-process worker, or a process per
rank) with the op table the args name, plans the cache once (its :class:`~rocm_k3.cache.geometry.CacheGeometry`:
measured on a GPU, the configured budgets on the CPU) and allocates it on every worker, loads the tokenizer and builds the request side (chat frontend, image processor). ``LLM``,
``rocm-k3 generate``, ``rocm-k3 serve`` and the benchmarks all start here; :func:`run_headless_node` is the same
for the non-zero nodes of a multi-node run, which only host ranks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from rocm_k3.args import EngineArgs
from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.chat import ModelFrontend
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore, plan_cache
from rocm_k3.engine.dp_engine import DataParallelEngine
from rocm_k3.engine.multimodal import MultiModalProcessor
from rocm_k3.executor.multiproc import MultiprocExecutor
from rocm_k3.executor.replicas import ReplicaExecutor
from rocm_k3.executor.uniproc import UniprocExecutor
from rocm_k3.formats.parsers.registry import checkpoint_family
from rocm_k3.kv_transfer.config import KVTransferConfig
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.layout_check import check_layout
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.spec_decode.config import SpeculativeConfig
from rocm_k3.tokenizers import load_tokenizer
from rocm_k3.worker.worker import WorkerConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclasses.dataclass
class AssembledEngine:
    """A ready engine and what its front ends need.

    core:       the EngineCore (scheduler + cache manager) over its executor, cache allocated; with
                ``data_parallel_size`` > 1 a DataParallelEngine (one EngineCore per replica, same API).
    path:       the checkpoint directory served.
    tokenizer:  the checkpoint's tokenizer (or the override), None when it has none.
    family:     the output format family ("kimi_k3" / "kimi_k2") or None.
    frontend:   the request side shared by ``LLM.chat`` and the server (renderer, parsers, constraint checks).
    multimodal: the image processor of a vision checkpoint, else None.
    args:       the engine args it was assembled from.
    """

    core: EngineCore | DataParallelEngine
    path: Path
    tokenizer: Any
    family: str | None
    frontend: ModelFrontend
    multimodal: MultiModalProcessor | None
    args: EngineArgs

    @property
    def max_model_len(self) -> int:
        return self.core.config.max_model_len

    def shutdown(self) -> None:
        """Stop the executor's worker processes (idempotent)."""
        self.core.executor.shutdown()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device to serve on: default the current GPU if there is one, else the CPU; a bare "cuda" gets
    the current index."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from exc
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _worker_config(args: EngineArgs) -> WorkerConfig:
    """The validated args' worker config: device, dtype, checkpoint (default: the embedded model), family."""
    args.validated()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = Path(args.model) if args.model is not None else ensure_embedded_model()
    family = checkpoint_family(path, tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    parallel = args.parallel_config()
    if device.type == "cuda" and parallel.gpus_per_node > 1 and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if parallel.gpus_per_node > count:
            from rocm_k3.distributed.context import LayoutError

            raise LayoutError(f"{parallel.gpus_per_node} ranks per node (data x tensor x pipeline parallel / nnodes) but "
                              f"this node has {count} GPU(s)")
    return WorkerConfig(
        model_path=path, dtype=dtype, device=device, backend=args.backend, moe_act_quant=args.moe_act_quant,
        progress=args.progress, enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, parallel=parallel, output_family=family,
        speculative=SpeculativeConfig.parse(args.speculative_config),
        kv_transfer=KVTransferConfig.parse(args.kv_transfer_config),
    )


def run_headless_node(args: EngineArgs) -> int:
    """Node ``node_rank > 0`` of a multi-node run: this node's ranks, headless, until node 0 ends the group."""
    from rocm_k3.executor.multiproc import run_headless

    return run_headless(_worker_config(args))


def assemble_engine(args: EngineArgs, *, model: Any = None, tokenizer: Any = None) -> AssembledEngine:
    """The ready engine for ``args`` (see the module docstring).

    model: an already loaded model to serve (tests; one process only); tokenizer: overrides the checkpoint's.
    """
    worker_config = _worker_config(args)
    path = worker_config.model_path
    check_layout(ModelConfig.from_pretrained(path), worker_config.parallel)  # before any process starts
    if worker_config.parallel.is_single:
        executor = UniprocExecutor(worker_config, model=model)
    else:
        if model is not None:
            raise ValueError("model: a loaded model can only be served by one process (tensor_parallel_size 1)")
        executor = MultiprocExecutor(worker_config)
    info = executor.info()
    budgets = {name: value for name, value in (("kv_cache_bytes", args.kv_cache_bytes),
                                               ("state_cache_bytes", args.state_cache_bytes)) if value is not None}
    cache = CacheConfig(block_size=args.block_size, match_unit=args.match_unit, alignment=args.alignment,
                        kda_save_grid=info.kda_save_grid, enable_prefix_caching=args.enable_prefix_caching, **budgets)
    explicit = args.kv_cache_bytes is not None, args.state_cache_bytes is not None
    measured = None if all(explicit) else executor.cache_budget(cache.block_size)
    cache, geometry = plan_cache(cache, info, measured, args.max_model_len, *explicit)
    config = EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          max_model_len=geometry.max_model_len, cache=cache,
                          speculative=worker_config.speculative,
                          kv_transfer=worker_config.kv_transfer, async_scheduling=args.async_scheduling)
    executor.init_cache(geometry)
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    # stop ids: the config's eos ids and the tokenizer's generation stop ids (K3: <|end_of_msg|> and [EOS])
    eos = tuple(dict.fromkeys((*info.eos_token_ids, *getattr(tokenizer, "eos_token_ids", ()))))
    replicas = worker_config.parallel.data_parallel_size

    def engine_core(over) -> EngineCore:
        return EngineCore(config, over, geometry=geometry, vocab_size=info.vocab_size, eos_token_ids=eos,
                          tokenizer=tokenizer, accepts_images=info.accepts_images)

    if replicas == 1:
        core = engine_core(executor)
    else:  # DP attention: a scheduler and cache per replica, all ranks in one executor (every replica: same geometry)
        core = DataParallelEngine([engine_core(ReplicaExecutor(executor, d, replicas)) for d in range(replicas)],
                                  executor)
    family = worker_config.output_family
    multimodal = None
    if info.accepts_images and tokenizer is not None:
        multimodal = MultiModalProcessor.from_checkpoint(path, tokenizer)
    return AssembledEngine(core=core, path=path, tokenizer=tokenizer, family=family,
                           frontend=ModelFrontend(path, tokenizer, family), multimodal=multimodal, args=args)
