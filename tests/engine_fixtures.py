"""Test support: an EngineCore over an in-process worker serving an already loaded model."""

from __future__ import annotations

from pathlib import Path

from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore
from rocm_k3.executor.uniproc import UniprocExecutor
from rocm_k3.worker.kv_pools import KVPools
from rocm_k3.worker.worker import WorkerConfig


def core_for(model, config: EngineConfig, *, tokenizer=None, enforce_eager: bool = True,
             model_path: Path = Path("."), output_family: str | None = None, vision_model=None) -> EngineCore:
    """EngineCore for ``model`` (and ``vision_model``, which makes it take images) with the cache sized by
    ``config.cache`` (explicit counts or byte budgets).

    model_path / output_family: where the worker finds the tokenizer for grammars, and their family."""
    worker = WorkerConfig(model_path=model_path, dtype=model.dtype, device=model.device, enforce_eager=enforce_eager,
                          max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                          output_family=output_family, speculative=config.speculative)
    executor = UniprocExecutor(worker, model=model, vision_model=vision_model)
    info = executor.info()
    geometry = config.cache.plan(bytes_per_token=info.bytes_per_token, bytes_per_slot=info.bytes_per_slot,
                                 max_model_len=config.max_model_len)
    executor.init_cache(geometry)
    eos = tuple(dict.fromkeys((*info.eos_token_ids, *getattr(tokenizer, "eos_token_ids", ()))))
    return EngineCore(config, executor, geometry=geometry, vocab_size=info.vocab_size, eos_token_ids=eos, tokenizer=tokenizer, accepts_images=info.accepts_images)


def pools_of(core: EngineCore) -> KVPools:
    return core.executor.worker.runner.pools
