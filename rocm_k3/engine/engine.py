"""LLMEngine: continuous batching of requests over the paged hybrid cache with prefix caching.

``step()`` = schedule -> copy-on-write + forward (runner) -> publish cache entries -> sample -> stop checks.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import torch

from rocm_k3.cache.errors import RequestTooLargeError
from rocm_k3.cache.hybrid_cache import CacheGeometry, HybridCache
from rocm_k3.cache.manager import CacheManager
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.outputs import RequestOutput
from rocm_k3.engine.runner import ModelRunner
from rocm_k3.engine.sampler import check_stop, make_generator, sample
from rocm_k3.engine.sampling import SamplingParams
from rocm_k3.engine.scheduler import Scheduler
from rocm_k3.engine.sequence import Sequence


class FinishedRequest(NamedTuple):
    request_id: str
    output: RequestOutput


@dataclasses.dataclass
class _RequestState:
    params: SamplingParams
    generator: torch.Generator
    logprobs: list[dict[int, float]] | None


class LLMEngine:
    """Serve many requests at once on one model.

    model: a model with ``forward(ForwardBatch, HybridCacheView) -> logits fp32 [N, vocab]`` and ``cfg``
    (ModelConfig), ``dtype``, ``device``; config: EngineConfig; eos_token_ids: stop ids unless ignore_eos;
    tokenizer: optional, with ``decode(ids) -> str`` (needed for stop strings).
    """

    def __init__(
        self, model: Any, config: EngineConfig, *, eos_token_ids: Seq[int] = (), tokenizer: Any = None
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected EngineConfig, got {type(config).__name__}")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        cc = config.cache
        geometry = CacheGeometry.from_model_config(model.cfg, model.dtype)
        num_blocks, num_slots = cc.resolve(
            bytes_per_block=geometry.bytes_per_block(cc.block_size),
            bytes_per_slot=geometry.bytes_per_slot(),
            max_model_len=config.max_model_len,
        )
        self.cache_manager = CacheManager(cc, num_blocks, num_slots)
        self.cache = HybridCache(
            geometry, block_size=cc.block_size, num_blocks=num_blocks, num_slots=num_slots, device=model.device
        )
        self.scheduler = Scheduler(config, self.cache_manager)
        self.runner = ModelRunner(model, self.cache, self.cache_manager)
        self._seqs: dict[str, Sequence] = {}
        self._state: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_prefill_tokens = 0

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Queue a request. RequestTooLargeError if its prompt exceeds max_model_len; generation is capped so
        that prompt + generated tokens fit in max_model_len (finish reason "length")."""
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        vocab = self.model.cfg.vocab_size
        prompt = [int(t) for t in prompt_token_ids]
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {request_id!r}: prompt token ids outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(prompt) > limit:
            raise RequestTooLargeError(
                f"request {request_id!r}: {len(prompt)} prompt tokens exceed max_model_len={limit}"
            )
        # the last generated token is never fed back, so prompt + max_tokens - 1 positions are needed
        max_tokens = min(params.max_tokens, limit - len(prompt) + 1)
        seq = Sequence(
            seq_id=next(self._ids),
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            sampling=params,
        )
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        self._state[request_id] = _RequestState(
            params, make_generator(params.seed, self.model.device), [] if params.logprobs is not None else None
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its cache; False if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.abort(seq)
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> list[FinishedRequest]:
        """Run one scheduled step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are pending")
            return []
        try:
            logits = self.runner.execute(out)  # [N, vocab]
        except BaseException:
            self.scheduler.abandon(out)  # the requests stay queued and are recomputed by the next step
            raise
        self.scheduler.postprocess(out)
        self.num_steps += 1
        self.num_prefill_tokens += sum(item.num_new_tokens for item in out.scheduled if item.is_prefill)
        rows = [i for i, item in enumerate(out.scheduled) if item.samples]
        if not rows:
            return []
        seqs = [out.scheduled[i].seq for i in rows]
        states = [self._state[s.request_id] for s in seqs]
        sampled = sample(logits[rows], [st.params for st in states], [st.generator for st in states])
        finished: list[FinishedRequest] = []
        for k, (seq, st) in enumerate(zip(seqs, states)):
            token = int(sampled.token_ids[k])
            seq.token_ids.append(token)
            if st.logprobs is not None:
                st.logprobs.append(sampled.logprobs[k])
            generated = seq.output_token_ids
            # decoding every step is only needed to look for stop strings; otherwise once, at the end
            watch_text = self.tokenizer is not None and bool(st.params.stop)
            text = self.tokenizer.decode(generated) if watch_text else ""
            decision = check_stop(generated, text, st.params, self.eos_token_ids)
            reason = decision.finish_reason
            if reason is None and len(generated) >= seq.max_tokens:
                reason = "length"  # capped by max_model_len
            if reason is not None:
                self.scheduler.finish(seq, reason)
                finished.append(
                    FinishedRequest(
                        seq.request_id,
                        RequestOutput(
                            list(seq.prompt_token_ids),
                            generated,
                            self._final_text(generated, decision.text, watch_text),
                            st.logprobs,
                            reason,
                        ),
                    )
                )
                self._forget(seq.request_id)
        return finished

    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until every queued request finished; outputs by request id."""
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for req in self.step():
                done[req.request_id] = req.output
        return done

    # ---- counters ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Prefix-cache counters (queries, query_tokens, hit_requests, hit_tokens, hit_rate, saved_states,
        cow_copies, state_restores, block/state evictions) plus steps, computed prefill tokens, preemptions."""
        out = self.cache_manager.stats.as_dict()
        out.update(
            steps=self.num_steps,
            prefill_tokens=self.num_prefill_tokens,
            preemptions=self.scheduler.num_preemptions,
            num_blocks=self.cache_manager.blocks.size,
            num_state_slots=self.cache_manager.slots.size,
        )
        return out

    def _final_text(self, generated: list[int], checked_text: str, watched: bool) -> str:
        if watched:
            return checked_text  # already cut before a matched stop string
        return self.tokenizer.decode(generated) if self.tokenizer is not None else ""

    def _forget(self, request_id: str) -> None:
        del self._seqs[request_id]
        del self._state[request_id]
