"""EngineCore: the control plane of one model = Scheduler + CacheManager + an Executor. No tensors, no model code.

``step()`` = ``schedule() -> StepInput`` -> ``executor.execute`` -> ``update(StepOutput)`` -> request deltas.

Pipeline parallelism: an executor whose ``pipeline_depth`` is > 1 (one per stage) takes steps with ``submit`` and
returns their outputs in order with ``collect``; ``step()`` then keeps up to that many micro-batches in flight
(the scheduler leaves a step's sequences out of the next ones until its output is applied), so the first stage
starts step N + 1 while the last one still runs step N. ``stats()`` counts the steps in flight at each collect
(``steps_in_flight_max`` / ``steps_in_flight_mean``).

Asynchronous scheduling (``EngineConfig.async_scheduling``) reuses that machinery with two steps in flight on the
in-process executor: ``submit`` launches step N + 1 on the device (its plain decodes take their input token from
step N's samples there, see :class:`~rocm_k3.engine.scheduler.Scheduler`) before ``collect`` reads step N back, so
the host's output processing and scheduling overlap the device's step. A request that finishes in step N has its
step N + 1 token dropped; its cache is freed once that step is collected.

Robustness (each a tested promise):

- **Transactional bookkeeping.** Every scheduler/cache section runs under an :class:`InterruptGuard`, so a
  Ctrl-C lands between sections, never inside one. A step whose execution fails (or is interrupted) is
  abandoned: its requests go back to the queue to be recomputed (not counted as preemptions). Any exception
  that escapes a bookkeeping section anyway (a bug, a failing callback such as the tokenizer, or an exception
  injected by a test at an arbitrary line) triggers :meth:`EngineCore.recover`: the integer bookkeeping is
  rebuilt from scratch (the prefix cache is dropped) and every unfinished request is re-queued to be recomputed
  from its prompt and outputs. Each call is all or nothing for the caller: a step cut short (also by a Ctrl-C
  deferred to the end of its update) is rolled back (no token, text or finish of it is kept, so none is lost
  from the stream); a request whose ``add_request`` raised is not queued; an ``abort`` that raised has still
  aborted. Afterwards every block and slot is free or held by a live request (tests/engine/test_interrupt_fuzz.py
  raises at every line of the bookkeeping in turn).
- **Validation before registration.** Prompt ids, length, sampling parameters, stop strings without a tokenizer,
  image pad spans (and images for a model without a vision tower) and duplicate ids raise a ValueError/TypeError
  naming the problem before anything is queued.
- **Non-finite logits** finish only the affected request, with finish reason "error" and a message.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Sequence as Seq
from typing import Any

from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.errors import check_prompt_length
from rocm_k3.cache.geometry import CacheGeometry
from rocm_k3.cache.image_salt import prefix_cache_key
from rocm_k3.cache.manager import CacheManager
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.guard import InterruptGuard
from rocm_k3.engine.outputs import RequestDelta, RequestOutput
from rocm_k3.engine.scheduler import Scheduler
from rocm_k3.engine.sequence import Sequence
from rocm_k3.engine.stop import StopChecker
from rocm_k3.executor.base import Executor
from rocm_k3.kv_transfer.socket_scheduler import remote_prefill
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.step_io import ImageInput

log = logging.getLogger("rocm_k3.engine")


def plan_cache(cache: CacheConfig, info: Any, budget: tuple[int, int] | None, max_model_len: int | None,
               explicit_kv: bool, explicit_state: bool) -> tuple[CacheConfig, CacheGeometry]:
    """Resolve the cache size and ``max_model_len``: (cache config with the budgets used, its geometry).

    ``info``: the worker's ``bytes_per_token`` / ``bytes_per_slot`` and ``max_position_embeddings``.
    ``budget`` = bytes measured on the device (None on the CPU: the configured budgets apply); explicit budgets
    win over measured ones. ``max_model_len`` None = what one request can hold, at most max_position_embeddings
    (logged when that is less); an explicit value that cannot fit raises CacheBudgetError.
    """
    if budget is not None:
        kv, state = budget
        changes = {}
        if not explicit_kv and cache.num_blocks is None:
            changes["kv_cache_bytes"] = max(1, kv)
        if not explicit_state and cache.num_state_slots is None:
            changes["state_cache_bytes"] = max(1, state)
        if changes:
            cache = dataclasses.replace(cache, **changes)
    per_block, per_slot = cache.bytes_per_block(info.bytes_per_token), info.bytes_per_slot
    limit = info.max_position_embeddings
    if max_model_len is None:
        blocks, _ = cache.counts(bytes_per_block=per_block, bytes_per_slot=per_slot)
        fits = cache.max_len_for(blocks)
        max_model_len = min(limit, fits) if fits > 0 else limit  # limit then fails below with the named error
        if max_model_len < limit:
            log.warning("max_model_len defaults to %d tokens: what one request can hold in the KV cache "
                        "(max_position_embeddings is %d)", max_model_len, limit)
    elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
        raise ValueError(f"max_model_len: expected an int in [1, max_position_embeddings={limit}], "
                         f"got {max_model_len!r}")
    return cache, cache.plan(bytes_per_token=info.bytes_per_token, bytes_per_slot=per_slot,
                             max_model_len=max_model_len)


class EngineCore:
    """Requests in, deltas out (see the module docstring).

    config: the engine config (its cache sizes already resolved, see :func:`plan_cache`); geometry: the planned
    cache the executor allocated (its granularities must be ``config.cache``'s); tokenizer: optional ``decode(ids) -> str`` (text outputs, stop strings);
    accepts_images: the workers hold a vision tower (``WorkerInfo.accepts_images``).
    """

    def __init__(self, config: EngineConfig, executor: Executor, *, geometry: CacheGeometry, vocab_size: int,
                 eos_token_ids: Seq[int] = (), tokenizer: Any = None, accepts_images: bool = False) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected EngineConfig, got {type(config).__name__}")
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.accepts_images = accepts_images
        if not isinstance(geometry, CacheGeometry):
            raise TypeError(f"geometry: expected CacheGeometry, got {type(geometry).__name__}")
        c = config.cache
        if (geometry.block_size, geometry.match_unit, geometry.alignment, geometry.kda_save_grid,
                geometry.enable_prefix_caching) != (c.block_size, c.match_unit, c.alignment, c.kda_save_grid,
                                                   c.enable_prefix_caching):
            raise ValueError(f"geometry: {geometry} does not match the engine's cache config {c}")
        if geometry.max_model_len < config.max_model_len:
            raise ValueError(f"geometry: planned for max_model_len={geometry.max_model_len}, the engine allows "
                             f"{config.max_model_len}")
        self.geometry = geometry
        self.num_blocks, self.num_slots = geometry.num_blocks, geometry.num_slots
        self.guard = InterruptGuard()
        self._seq_ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_recoveries = 0
        self.num_sampler_fallbacks = 0
        self.depth = int(getattr(executor, "pipeline_depth", 1))  # steps in flight at once (pipeline stages)
        if config.async_scheduling:
            if self.depth != 1 or not getattr(executor, "supports_async_scheduling", False):
                raise ValueError(f"async_scheduling: needs the in-process executor with one pipeline stage, got "
                                 f"{type(executor).__name__} (pipeline depth {self.depth})")
            self.depth = 2  # step N + 1 is scheduled and launched before step N's output is read
        self.in_flight_max = 0
        self.in_flight_sum = 0  # steps in flight summed over the collects (their mean: stats())
        self.num_collects = 0
        self.kv_stats: collections.Counter = collections.Counter()  # prefill/decode transfers (see Scheduler)
        self._new_bookkeeping()

    def _new_bookkeeping(self) -> None:
        self.cache_manager = CacheManager(self.config.cache, self.num_blocks, self.num_slots)
        self.scheduler = Scheduler(self.config, self.cache_manager, self.kv_stats, max_in_flight=self.depth)

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    images: Seq[ImageInput] = ()) -> None:
        """Queue a request; every check runs before anything is registered.

        images: the prompt's images (:class:`~rocm_k3.worker.step_io.ImageInput`, from
        :mod:`rocm_k3.engine.multimodal`), their pad spans ascending and inside the prompt; the prefix cache then
        matches on the prompt with each image's pads salted by its content hash.
        PromptTooLongError (a RequestTooLargeError) if the prompt exceeds max_model_len (the only length check:
        ``LLM`` and the server rely on it); generation is capped so that prompt +
        generated tokens fit (finish reason "length").
        """
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id: expected a non-empty str, got {request_id!r}")
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise TypeError(f"request {request_id!r}: prompt token ids must be ints")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"request {request_id!r}: prompt token ids outside the vocabulary [0, {self.vocab_size})")
        limit = self.config.max_model_len
        check_prompt_length(len(prompt), limit, f"request {request_id!r}: prompt")
        images = self._check_images(request_id, images, len(prompt))
        remote_prefill(params.kv_transfer_params)  # ValueError naming a malformed key
        # the last generated token is never fed back, so prompt + max_tokens - 1 positions are needed
        max_tokens = min(params.max_tokens, limit - len(prompt) + 1)
        stop = StopChecker(params, self.eos_token_ids, self.tokenizer, max_tokens)  # ValueError: stop w/o tokenizer
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=prompt,
                       max_tokens=max_tokens, sampling=params, stop=stop,
                       logprobs=[] if params.logprobs is not None else None, images=images,
                       prompt_logprobs=None if params.prompt_logprobs is None else [None],
                       prompt_logprob_ranks=None if params.prompt_logprobs is None else [None],
                       kv_transfer_params=params.kv_transfer_params,
                       prompt_cache_key=prefix_cache_key(prompt, images) if images else None)
        try:
            with self.guard.section():
                self._seqs[request_id] = seq
                self.scheduler.add(seq)
        except BaseException:  # all or nothing (also for a Ctrl-C deferred to the section's end): not queued
            with self.guard.section():
                self._seqs.pop(request_id, None)
                if seq in self.scheduler.waiting:
                    self.scheduler.waiting.remove(seq)
            raise

    def _check_images(self, request_id: str, images: Seq[ImageInput], prompt_len: int) -> tuple[ImageInput, ...]:
        """The images of a request, checked: a vision model, ImageInput items, ascending disjoint pad spans."""
        if isinstance(images, ImageInput) or not isinstance(images, (list, tuple)):
            raise TypeError(f"request {request_id!r}: images: expected a list of ImageInput, got "
                            f"{type(images).__name__}")
        images = tuple(images)
        if not images:
            return images
        if not self.accepts_images:
            raise ValueError(f"request {request_id!r}: this model has no vision tower (no vision_config): it takes "
                             "no images")
        end = 0
        for i, image in enumerate(images):
            if not isinstance(image, ImageInput):
                raise TypeError(f"request {request_id!r}: images[{i}]: expected an ImageInput, got "
                                f"{type(image).__name__}")
            if image.pad_start < end or image.pad_end > prompt_len:
                raise ValueError(f"request {request_id!r}: images[{i}] pads [{image.pad_start}, {image.pad_end}) "
                                 f"overlap the previous image or leave the {prompt_len}-token prompt")
            end = image.pad_end
        return images

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its cache; False if it is unknown or already finished. An exception inside
        still aborts it (the bookkeeping is rebuilt without it) before it propagates."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        if seq.is_finished:  # (finished requests leave _seqs with their last delta)
            with self.guard.section():
                self._seqs.pop(request_id, None)
            return False
        done = False
        try:
            with self.guard.section():
                if self.depth == 1 and self.scheduler.in_flight is not None:  # a step an exception cut short:
                    # its pins go first (with pipelining, steps in flight are live and drop the request later)
                    self.scheduler.abandon()
                self.scheduler.abort(seq)
                self._seqs.pop(request_id)
                done = True
                return True
        except BaseException:
            if not done:  # finish the abort on rebuilt bookkeeping
                with self.guard.section():
                    self._seqs.pop(request_id, None)
                    if not seq.is_finished:
                        self.recover()  # re-queues the requests still in _seqs: all but this one
                    self.scheduler.retire(seq, seq.finish_reason or "abort")  # the workers hear of it (again)
            raise

    def has_unfinished(self) -> bool:
        """Requests queued or running, or a step still in flight (pipelined: an aborted request's step must still
        be collected so its slots and copies come back)."""
        return self.scheduler.has_unfinished() or bool(self.scheduler.steps_in_flight)

    # ---- one step ------------------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise the executor's error if one of its worker processes has ended (a no-op in one process)."""
        check = getattr(self.executor, "check_alive", None)
        if check is not None:
            check()

    def step(self) -> list[RequestDelta]:
        """Run one scheduled step; returns a delta per request that got a token (or failed) in it.

        All or nothing: when an exception escapes, no request has advanced (the step's tokens are dropped, to be
        computed again) and every block and slot is free or held by a live request."""
        if self.depth > 1:
            deltas = self._pipelined_step()
            while self.scheduler.steps_in_flight and not self.scheduler.has_unfinished():
                # what is left in flight holds only finished requests (a token scheduled ahead of a stop, an
                # abort): collect it now, so that their cache is back when the last request's delta is returned
                deltas += self._pipelined_step()
            return deltas
        try:
            step = self._schedule_step()
            if step is None:
                return []
            output = self.executor.execute(step)
            return self._commit(step, output)
        except BaseException:  # also a Ctrl-C deferred to the end of a section
            self.abandon_step()  # requests stay queued and are recomputed
            raise

    def _pipelined_step(self) -> list[RequestDelta]:
        """Fill the pipeline (schedule and submit steps while fewer than ``depth`` are in flight and one finds
        work), then apply the oldest step's output. On an exception every step in flight is abandoned (its
        requests recomputed); the executor still runs them, and their outputs are dropped when they come."""
        sched = self.scheduler
        try:
            while len(sched.steps_in_flight) < self.depth:
                step = self._schedule_step()
                if step is None:  # every sequence that could run is in flight already (or none is left)
                    break
                self.executor.submit(step)
            if not sched.steps_in_flight:
                return []
            n = len(sched.steps_in_flight)
            self.in_flight_max = max(self.in_flight_max, n)
            self.in_flight_sum += n
            self.num_collects += 1
            oldest = sched.steps_in_flight[0].step
            output = self.executor.collect()
            while output.step_id != oldest.step_id:  # a step abandoned earlier: nothing of it is kept
                if output.step_id > oldest.step_id:
                    raise RuntimeError(f"executor returned step {output.step_id} before step {oldest.step_id}")
                output = self.executor.collect()
            return self._commit(oldest, output)
        except BaseException:
            self.abandon_step()  # requests stay queued and are recomputed
            raise

    def _schedule_step(self):
        """Schedule one more step and hold it in flight; None when it found no chunk (then dropped). With one step
        at a time (``depth`` 1) a step still in flight is one an interrupt cut short (between two sections): it is
        dropped first; pipelined, the steps in flight are live. RuntimeError when nothing is in flight although
        requests are pending (no progress)."""
        sched = self.scheduler
        with self.guard.section():
            if self.depth == 1 and sched.in_flight is not None:
                self._bookkeeping(sched.abandon)
            step = self._bookkeeping(sched.schedule)
            if not step.chunks:
                self._bookkeeping(lambda: sched.abandon(newest_only=True))
        if step.chunks:
            return step
        if not sched.steps_in_flight and sched.has_unfinished():
            raise RuntimeError("scheduler made no progress although requests are pending")
        return None

    def begin_step(self):
        """The first half of :meth:`step` (a data-parallel engine runs it per replica): schedule the next
        StepInput (None when it has no chunk) and hold it in flight until :meth:`finish_step` commits its output or
        :meth:`abandon_step` drops it."""
        try:
            return self._schedule_step()
        except BaseException:
            self.abandon_step()
            raise

    def abandon_step(self) -> None:
        """Drop every step in flight (their requests stay queued and are recomputed); a no-op without one (also
        after a :meth:`recover`, whose fresh scheduler has none)."""
        with self.guard.section():
            if self.scheduler.steps_in_flight:
                self._bookkeeping(self.scheduler.abandon)

    def finish_step(self, step, output) -> list[RequestDelta]:
        """The second half of :meth:`step`: commit the executed ``step``'s ``output``; the deltas."""
        try:
            return self._commit(step, output)
        except BaseException:
            self.abandon_step()
            raise

    def return_finished_ids(self, ids: tuple[str, ...]) -> None:
        """Ids from :meth:`take_finished_ids` whose step failed: told to the workers with a later step."""
        with self.guard.section():
            self.scheduler.return_finished_ids(ids)

    def take_finished_ids(self) -> tuple[str, ...]:
        """Finished requests the workers were not yet told of (for a step without chunks that tells them)."""
        with self.guard.section():
            return tuple(self.scheduler.take_finished_ids())

    @property
    def num_requests(self) -> int:
        """Requests queued or running (finished and aborted ones leave)."""
        return len(self._seqs)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    def _commit(self, step, output) -> list[RequestDelta]:
        """The scheduler's update of an executed step and the engine's own records, rolled back together when an
        exception cuts them short (the bookkeeping is then rebuilt, see :meth:`recover`)."""
        checkpoint = self.scheduler.checkpoint()  # an exception before the try: the step is abandoned
        counters = self.num_steps, self.num_prefill_tokens, self.num_sampler_fallbacks
        try:
            with self.guard.section():  # the try encloses it: a Ctrl-C deferred to its end rolls back too
                deltas = self.scheduler.update(output)
                self.num_steps += 1
                self.num_sampler_fallbacks += output.sampler_fallbacks
                self.num_prefill_tokens += sum(c.num_tokens for c in step.chunks if c.is_prefill)
                for d in deltas:
                    if d.finished:
                        self._seqs.pop(d.request_id, None)
                return deltas
        except BaseException:
            with self.guard.section():
                self.num_steps, self.num_prefill_tokens, self.num_sampler_fallbacks = counters
                for seq in self.scheduler.roll_back(checkpoint):
                    self._seqs[seq.request_id] = seq
                self.recover()
            raise

    def expert_loads(self, reset: bool = False) -> dict[int, list[int]]:
        """Picks per logical expert of each MoE layer, as the expert-parallel ranks counted them ({} without
        expert parallelism); every TP rank of a stage counts the same routing, so TP rank 0 of each speaks."""
        out: dict[int, list[int]] = {}
        for r in self.executor.rank_stats(reset):
            if r["tp_rank"] == 0:
                out.update({int(k): list(v) for k, v in r.get("expert_load", {}).items()})
        return dict(sorted(out.items()))

    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until every queued request finished; outputs by request id."""
        done = {}
        while self.has_unfinished():
            for delta in self.step():
                if delta.finished:
                    done[delta.request_id] = delta.output
        return done

    def _bookkeeping(self, fn):
        """Run a scheduler/cache section; on any exception rebuild the bookkeeping (see :meth:`recover`)."""
        try:
            return fn()
        except BaseException:
            self.recover()
            raise

    def recover(self) -> None:
        """Rebuild the integer bookkeeping after an exception escaped it: a fresh cache manager (all blocks and
        slots free, prefix cache empty) and scheduler; every unfinished request is re-queued to be recomputed
        from its prompt and outputs, in its old order. Not counted as preemptions."""
        with self.guard.section():
            old = self.scheduler
            order = list(dict.fromkeys([*old.running, *old.waiting, *self._seqs.values()]))
            # the engine's requests are the truth: a sequence the scheduler holds for a request the engine does
            # not know (cut short while being added or aborted) is dropped
            order = [s for s in order if self._seqs.get(s.request_id) is s and not s.is_finished]
            finished_ids = old.take_finished_ids()
            preemptions = old.num_preemptions
            step_id = old.step_id
            counters = self.cache_manager.stats, old.spec.stats  # cumulative: /metrics counters never go back
            self._new_bookkeeping()
            self.cache_manager.stats, self.scheduler.spec.stats = counters
            self.scheduler.restore(order, num_preemptions=preemptions, step_id=step_id, finished_ids=finished_ids)
            self.num_recoveries += 1
            log.warning("engine bookkeeping rebuilt after an exception; %d requests re-queued", len(order))

    # ---- counters ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Prefix-cache counters (queries, query_tokens, hit_requests, hit_tokens, hit_rate, saved_states,
        cow_copies, state_restores, block/state evictions) plus steps, computed prefill tokens, preemptions,
        sampler fallbacks (rows whose processed probabilities were unusable: the top logit was taken),
        cache sizes and what is free now (free_blocks / free_state_slots count free and evictable ids)."""
        mgr = self.cache_manager
        out = mgr.stats.as_dict()
        out.update(
            steps=self.num_steps,
            prefill_tokens=self.num_prefill_tokens,
            preemptions=self.scheduler.num_preemptions,
            recoveries=self.num_recoveries,
            sampler_fallbacks=self.num_sampler_fallbacks,
            steps_in_flight_max=self.in_flight_max,
            steps_in_flight_mean=self.in_flight_sum / self.num_collects if self.num_collects else 0.0,
            num_blocks=mgr.blocks.size,
            num_state_slots=mgr.slots.size,
            free_blocks=mgr.blocks.num_available,
            free_state_slots=mgr.slots.pool.num_available,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            **{f"kv_transfer_{k}": self.kv_stats[k]
               for k in ("loaded", "failures", "abandoned", "published", "bytes_received", "bytes_sent", "seconds")},
        )
        out.update(self.scheduler.spec.stats.as_dict())
        return out
