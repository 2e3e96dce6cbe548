"""Test support: an EngineCore over an in-process worker serving an already loaded model."""

from __future__ import annotations

from pathlib import Path

from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore
from rocm_k3.executor.uniproc import UniprocExecutor
from rocm_k3.worker.kv_pools import KVPools
from rocm_k3.worker.worker import WorkerConfig


def core_for(model, config: EngineConfig, *, tokenizer=None, enforce_eager: bool = True) -> EngineCore:
    """EngineCore for ``model`` with the cache sized by ``config.cache`` (explicit counts or byte budgets)."""
    worker = WorkerConfig(model_path=Path("."), dtype=model.dtype, device=model.device, enforce_eager=enforce_eager,
                          max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                          block_size=config.cache.block_size)
    executor = UniprocExecutor(worker, model=model)
    info = executor.info()
    num_blocks, num_slots = config.cache.resolve(bytes_per_block=info.bytes_per_block,
                                                 bytes_per_slot=info.bytes_per_slot,
                                                 max_model_len=config.max_model_len)
    executor.init_cache(num_blocks, num_slots, config.max_model_len)
    return EngineCore(config, executor, num_blocks=num_blocks, num_slots=num_slots, vocab_size=info.vocab_size,
                      eos_token_ids=info.eos_token_ids, tokenizer=tokenizer)


def pools_of(core: EngineCore) -> KVPools:
    return core.executor.worker.runner.pools
