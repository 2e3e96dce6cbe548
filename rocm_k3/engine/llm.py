"""The Python API: ``rocm_k3.LLM(path).generate(prompts, rocm_k3.SamplingParams(...))``.

``LLM()`` with no path serves the embedded tiny K3 model (built on first use into ``settings.cache_dir``).
Requests run on the continuous-batching engine (:class:`~rocm_k3.engine.engine.LLMEngine`: chunked prefill,
paged hybrid cache, prefix caching on by default); the engine and its prefix cache live as long as the LLM, so a
later ``generate`` call reuses prefixes of earlier ones. ``llm.stats()`` returns the prefix-cache counters.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.engine import LLMEngine
from rocm_k3.engine.outputs import RequestOutput
from rocm_k3.engine.sampling import SamplingParams
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.model.tokenizer import load_tokenizer
from rocm_k3.settings import BACKEND_CHOICES

Prompt = str | Sequence[int]  # also a 1-d integer numpy array / torch tensor
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class PromptTooLongError(ValueError):
    """A prompt with more tokens than the model's ``max_model_len``."""


class LLM:
    """A loaded model plus its tokenizer, generating from text prompts or token-id lists.

    path:          checkpoint directory (Kimi K3 or Kimi Linear layout); None = the embedded tiny K3 model.
    dtype:         "bfloat16" (default), "float32", "float16", a torch dtype, or "auto" (bfloat16 on a GPU, float32
                   on the CPU, where bfloat16 matmuls are slow).
    backend:       op backend for every op ("reference", "triton", "flydsl", "aiter"); None = settings / auto.
    max_model_len: the longest prompt + generation allowed; default and upper bound: max_position_embeddings.
    device:        torch device; default the first GPU if there is one, else the CPU.
    progress:      show a progress bar while the weights load.
    moe_act_quant: routed-expert activations: "bf16" (A16W4, default) or "mxfp8" (A8W4, what K3 was trained with).

    Engine and cache (see :mod:`rocm_k3.cache.config`; invalid combinations raise its named errors):
    enable_prefix_caching: reuse cached prefixes (KV pages + saved KDA states); outputs are the same either way.
    block_size / match_unit / alignment: KV page size, prefix hash granularity, prefill chunk grid (tokens).
    max_num_batched_tokens / max_num_seqs: new tokens and running requests per engine step.
    kv_cache_bytes / state_cache_bytes: memory budgets of the MLA pages and of the KDA state slots (None:
                   CacheConfig's defaults); CacheBudgetError if one max_model_len request cannot fit.
    """

    def __init__(self, path: str | Path | None = None, dtype: str | torch.dtype = "bfloat16",
                 backend: str | None = None, max_model_len: int | None = None,
                 device: str | torch.device | None = None, progress: bool = False,
                 moe_act_quant: str = "bf16", *, enable_prefix_caching: bool = True, block_size: int = 128,
                 match_unit: int = 64, alignment: int = 256, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 32, kv_cache_bytes: int | None = None,
                 state_cache_bytes: int | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = _resolve_dtype(dtype, self.device)
        if backend is not None and backend not in BACKEND_CHOICES:
            raise ValueError(f"backend: expected one of {BACKEND_CHOICES} or None, got {backend!r}")
        self.path = Path(path) if path is not None else ensure_embedded_model()
        self.model = load_model(self.path, dtype=self.dtype, device=self.device, backend=backend, progress=progress,
                                moe_act_quant=moe_act_quant)
        self.config = self.model.cfg
        limit = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len: expected an int in [1, max_position_embeddings={limit}], "
                             f"got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.tokenizer = load_tokenizer(self.path)  # None: token-id prompts only
        self.eos_token_ids = tuple(self.config.eos_token_id)
        budgets = {name: value for name, value in (("kv_cache_bytes", kv_cache_bytes),
                                                   ("state_cache_bytes", state_cache_bytes)) if value is not None}
        cache = CacheConfig(block_size=block_size, match_unit=match_unit, alignment=alignment,
                            enable_prefix_caching=enable_prefix_caching, **budgets)
        engine_config = EngineConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, cache=cache)
        self.engine = LLMEngine(self.model, engine_config, eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer)
        self._request_ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt: a str, token ids (a list of ints, numpy / torch integer scalars included, or a
        1-d integer numpy array / torch tensor), or a list of those; a 2-d integer array / tensor is one prompt per
        row. Returns one output per prompt. A ``bytes`` prompt is refused (TypeError): decode it to a str.

        sampling_params: one SamplingParams for all prompts, one per prompt, or None (defaults).
        Raises PromptTooLongError for a prompt longer than ``max_model_len``, ValueError for an empty prompt,
        out-of-vocabulary ids or a text prompt when the checkpoint has no tokenizer.
        """
        batch = _as_prompt_list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(batch)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch) or not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError(f"sampling_params: expected one SamplingParams or {len(batch)} of them, "
                                 f"got {len(params)} items")
        prompt_ids = [self._encode(p, i) for i, p in enumerate(batch)]
        return self._run_requests(prompt_ids, params)

    # ------------------------------------------------------------------ internals
    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index}: {self.path} has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index}: empty prompt")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {index}: token ids {bad[:8]} outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"prompt {index}: {len(ids)} tokens exceed max_model_len={self.max_model_len}"
            )
        return ids

    def stats(self) -> dict[str, float]:
        """Prefix-cache and engine counters: queries, query_tokens, hit_requests, hit_tokens, hit_rate, saved_states,
        cow_copies, state_restores, block/state evictions, steps, prefill_tokens, preemptions, cache sizes."""
        return self.engine.stats()

    def _run_requests(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Run every request to completion on the engine (batched); outputs in prompt order."""
        request_ids = [str(next(self._request_ids)) for _ in prompt_ids]
        try:
            for rid, ids, p in zip(request_ids, prompt_ids, params):
                self.engine.add_request(rid, ids, p)
            done = self.engine.run_to_completion()
        except BaseException:
            for rid in request_ids:  # leave the engine empty for the next call
                self.engine.abort(rid)
            raise
        return [done[rid] for rid in request_ids]


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


_BYTES = (bytes, bytearray, memoryview)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """str -> [str]; token ids -> [[int, ...]]; a 2-d array -> one prompt per row; a list of str / ids stays a list.

    Token ids come out as Python ints. Raises TypeError naming the prompt for bytes, non-integer ids or arrays of
    another dtype or rank, ValueError for an empty batch.
    """
    if isinstance(prompts, str):
        return [prompts]
    _refuse_bytes("prompts", prompts)
    if _is_array(prompts):
        ids = _array_ids("prompts", prompts, rows=True)
        if ids and isinstance(ids[0], list):
            return ids
        return [ids]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts: expected a str, a list of token ids, or a non-empty list of those, got {prompts!r}")
    if all(_is_token_id(p) for p in prompts):
        return [[int(p) for p in prompts]]
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        name = f"prompts[{i}]"
        _refuse_bytes(name, p)
        if isinstance(p, str):
            out.append(p)
        elif _is_array(p):
            out.append(_array_ids(name, p, rows=False))
        elif isinstance(p, Sequence):
            for j, t in enumerate(p):
                if not _is_token_id(t):
                    raise TypeError(f"{name}: token ids must be ints, got {t!r} ({type(t).__name__}) at position {j}")
            out.append([int(t) for t in p])
        else:
            raise TypeError(f"{name}: expected a str or a list of int token ids, got {type(p).__name__}")
    return out


def _refuse_bytes(name: str, prompt: Any) -> None:
    if isinstance(prompt, _BYTES):
        raise TypeError(f"{name}: got {type(prompt).__name__}; a bytes prompt is neither text nor token ids: decode "
                        "it to a str or pass a list of token ids")


def _is_token_id(t: Any) -> bool:
    """Python / numpy integers; never bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _array_ids(name: str, x: torch.Tensor | np.ndarray, rows: bool) -> list[int] | list[list[int]]:
    """The token ids of an integer array: 1-d -> one prompt; 2-d (when ``rows``) -> one prompt per row."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name}: expected integer token ids, got a torch tensor of dtype {x.dtype}")
    elif x.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer token ids, got a numpy array of dtype {x.dtype}")
    if x.ndim == 1 or (rows and x.ndim == 2):
        return x.tolist()
    what = "a 1-d (one prompt) or 2-d (a prompt per row)" if rows else "a 1-d"
    raise TypeError(f"{name}: expected {what} array of token ids, got shape {tuple(x.shape)}")
