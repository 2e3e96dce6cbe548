"""Engine configuration: scheduler limits next to the cache configuration, validated together."""

from __future__ import annotations

import dataclasses

from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.errors import TokenBudgetError
from rocm_k3.kv_transfer.config import KVTransferConfig
from rocm_k3.settings import DEFAULT_MAX_NUM_BATCHED_TOKENS
from rocm_k3.spec_decode.config import SpeculativeConfig



@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Validated engine knobs.

    max_num_batched_tokens: new tokens per step (prefill chunks + decodes); the default is measured
                            (:data:`DEFAULT_MAX_NUM_BATCHED_TOKENS`).
    long_prefill_token_threshold: most tokens of one prefill chunk per step, rounded up to ``cache.alignment``
                            (chunks that do not end a prompt end on the alignment grid); 0: no cap beyond the budget.
    max_num_seqs:           running sequences at once.
    max_model_len:          prompt + generated tokens of one request; also sizes the cache budget check.
    cache:                  the hybrid cache (block size, match unit, alignment, budgets, prefix caching).
    speculative:            speculative decoding (``--speculative-config``), or None.
    kv_transfer:            prefill/decode disaggregation (``--kv-transfer-config``), or None.
    async_scheduling:       schedule step N + 1 while step N runs (``--async-scheduling``, vLLM's name): a plain
                            decode in flight is scheduled again with its input token left to the worker (the token
                            step N samples, taken on the device), so the host's output processing and scheduling
                            hide behind the device's step. One pipeline stage, the in-process executor; not with
                            speculative decoding nor prefill/decode disaggregation (a ValueError names them).

    A step must be able to carry one aligned prefill chunk next to a decode token of every other running
    sequence, otherwise a long prompt could wait forever: ``max_num_batched_tokens >= alignment + max_num_seqs - 1``.
    """

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    long_prefill_token_threshold: int = 0
    max_num_seqs: int = 32
    max_model_len: int = 4096
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name}: expected a positive int, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"EngineConfig.long_prefill_token_threshold: expected an int >= 0 (0: no cap), "
                             f"got {threshold!r}")
        if not isinstance(self.cache, CacheConfig):
            raise TypeError(f"EngineConfig.cache: expected CacheConfig, got {type(self.cache).__name__}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"EngineConfig.speculative: expected SpeculativeConfig or None, "
                            f"got {type(self.speculative).__name__}")
        if self.kv_transfer is not None and not isinstance(self.kv_transfer, KVTransferConfig):
            raise TypeError(f"EngineConfig.kv_transfer: expected KVTransferConfig or None, "
                            f"got {type(self.kv_transfer).__name__}")
        if not isinstance(self.async_scheduling, bool):
            raise TypeError(f"EngineConfig.async_scheduling: expected a bool, got {self.async_scheduling!r}")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling: cannot be combined with speculative decoding (a verification needs "
                             "the previous step's tokens on the host to draft from)")
        if self.async_scheduling and self.kv_transfer is not None:
            raise ValueError("async_scheduling: cannot be combined with kv_transfer_config (a failed prompt-cache "
                             "load drops the step's token, which the next step would already have used)")
        need = self.cache.alignment + self.max_num_seqs - 1
        if self.max_num_batched_tokens < need:
            raise TokenBudgetError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below alignment={self.cache.alignment} "
                f"+ max_num_seqs={self.max_num_seqs} - 1 = {need}: an aligned prefill chunk could starve behind decodes"
            )

    @property
    def prefill_chunk_cap(self) -> int:
        """Most tokens of one prefill chunk in a step: the threshold rounded up to the alignment, or the budget."""
        if self.long_prefill_token_threshold == 0:
            return self.max_num_batched_tokens
        align = self.cache.alignment
        return min(self.max_num_batched_tokens, -(-self.long_prefill_token_threshold // align) * align)
