"""Continuous batching over the hybrid cache: decodes first, then aligned prefill chunks, then admissions.

Each :meth:`Scheduler.schedule` builds one step under ``max_num_batched_tokens`` new tokens:

1. every running sequence past its prefill gets one decode token (FIFO);
2. running sequences still in prefill get the next chunk;
3. waiting sequences are admitted in FIFO order (a KDA slot, the longest usable cached prefix, blocks for the
   first chunk) while the budget, ``max_num_seqs`` and the cache allow; admission never preempts. With prefix
   caching, a sequence that shares a longer aligned prefix with a prefill in flight than the cache holds waits
   (and is passed over) until that prefill has saved its states, so a common prefix is computed once.

A prefill chunk that is not the last one of its prompt ends on a multiple of ``alignment`` (chunks of one
prefill therefore start on match-unit boundaries, where KDA states can be saved). When a running sequence needs a
block and none is free or evictable, the most recently admitted unscheduled running sequence is preempted: its
cache is released (its indexed prefix stays cached) and it returns to the front of the queue to be recomputed
from its prompt + outputs. Every prefix-cache lookup, save and index entry uses ``Sequence.cache_key_ids`` (the ids
with image pads salted by the image's hash), never the raw ids: prompts with the same text and different images
share nothing past the first pad. The step leaves as a picklable :class:`~rocm_k3.worker.step_io.StepInput`
(decodes first, new requests once, a request's images with the chunk that admits it, block-table deltas, KDA
slots, saves, copy-on-write copies); :meth:`Scheduler.update` takes the workers'
:class:`~rocm_k3.worker.step_io.StepOutput`, advances the sequences, publishes their prefix-cache entries,
appends the sampled tokens, checks the stop conditions and finishes requests.
"""

from __future__ import annotations

import collections
import dataclasses

from rocm_k3.cache.errors import RequestTooLargeError
from rocm_k3.cache.manager import CacheManager, CopyPlan
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.outputs import RequestDelta, RequestOutput
from rocm_k3.engine.sequence import Sequence, SequenceStatus
from rocm_k3.kv_transfer.base import ReqTransfer
from rocm_k3.kv_transfer.socket_scheduler import SocketConnectorScheduler, wants_remote_decode
from rocm_k3.spec_decode.planner import SpecPlanner
from rocm_k3.worker.step_io import PLACEHOLDER_TOKEN, NewRequest, ScheduledChunk, StepInput, StepOutput


@dataclasses.dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens [start, start + num_new_tokens) of ``seq.token_ids``.

    is_prefill: the chunk belongs to a (re)computed prefill (its full units are indexed afterwards).
    samples: the chunk computes the sequence's last token, so the step samples its next token.
    saves: (absolute position, KDA slot) pairs to save during this chunk (prefill), or the per-position state
           slots of a verification chunk (the state after each drafted position; speculative, never published).
    drafts: speculative tokens appended after the sequence's last token (a verification chunk), else empty.
    placeholder: asynchronous scheduling: a decode of the token the step in flight samples for the sequence (not
           yet in ``seq.token_ids``): it starts at ``seq.num_tokens`` and the workers take its input on the device.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    is_prefill: bool
    samples: bool = dataclasses.field(init=False)
    saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    drafts: list[int] = dataclasses.field(default_factory=list)
    placeholder: bool = False

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens - len(self.drafts) == len(self.seq.token_ids) + self.placeholder

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclasses.dataclass
class SchedulerOutput:
    """The scheduler's own view of a step in flight (``step`` is what the workers get)."""

    scheduled: list[ScheduledSeq]
    copies: CopyPlan
    preempted: list[Sequence]
    step: StepInput

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode(self) -> bool:
        return bool(self.scheduled) and all(not s.is_prefill and s.num_new_tokens == 1 for s in self.scheduled)


@dataclasses.dataclass
class UpdateCheckpoint:
    """What :meth:`Scheduler.update` may change, taken before it runs so that an exception can undo it.

    running: the running queue; num_finished_ids: length of the finished-id list; samplers: per sequence that
    samples in the step (the only ones whose tokens, text and status change): (sequence, token count, logprob
    count or None, characters of text emitted, draft proposal).
    """

    running: list[Sequence]
    num_finished_ids: int
    samplers: list[tuple[Sequence, int, int | None, int, tuple[int, tuple[int, ...]]]]


class Scheduler:
    """See the module docstring. kv_stats: the engine's prefill/decode transfer counters (kept across rebuilt
    schedulers): loaded / failures (prompts recomputed after a failed load) / abandoned (loads in a step that
    failed or was rolled back: recomputed) / published / bytes."""

    def __init__(self, config: EngineConfig, cache: CacheManager,
                 kv_stats: collections.Counter | None = None, max_in_flight: int = 1) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected EngineConfig, got {type(config).__name__}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight: expected an int >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self.config = config
        self.async_scheduling = config.async_scheduling  # whole batches, plain decodes scheduled ahead
        self._free_after: set[int] = set()  # finished while in flight: cache freed once no step in flight holds them
        self.cache = cache
        self.alignment = config.cache.alignment
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.step_id = 0
        self.steps_in_flight: collections.deque[SchedulerOutput] = collections.deque()  # oldest first
        self._finished_ids: list[str] = []
        self.spec = SpecPlanner(config.speculative, cache, config.max_model_len)
        kv = config.kv_transfer
        self.connector = None if kv is None else SocketConnectorScheduler(kv, config.cache.block_size)
        self.kv_stats = collections.Counter() if kv_stats is None else kv_stats

    # ---- requests ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; RequestTooLargeError if it could never run."""
        need = seq.num_prompt_tokens + seq.max_tokens - 1  # the last generated token is never fed back
        if need > self.config.max_model_len:
            raise RequestTooLargeError(
                f"request {seq.request_id!r}: {seq.num_prompt_tokens} prompt tokens + max_tokens={seq.max_tokens} "
                f"- 1 = {need} positions exceed max_model_len={self.config.max_model_len}"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a waiting or running sequence and free its cache."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._free(seq)
        self.retire(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        """A running sequence is done (stop condition met): free its cache."""
        if seq.status is not SequenceStatus.RUNNING:
            raise ValueError(f"finish: sequence {seq.request_id!r} is {seq.status.value}, expected running")
        self.running.remove(seq)
        self._free(seq)
        self.retire(seq, reason)

    def _free(self, seq: Sequence) -> None:
        """Free a finished sequence's cache; with asynchronous scheduling only once no step in flight holds it
        (a step scheduled ahead still writes its blocks and KDA slot; its token is dropped)."""
        if self.async_scheduling and seq.seq_id in self.busy_ids():
            self._free_after.add(seq.seq_id)
        else:
            self.cache.free(seq.seq_id)

    def _free_deferred(self, out: SchedulerOutput) -> None:
        """After ``out`` left the steps in flight: free the finished sequences of it no other step holds."""
        if not self._free_after:
            return
        busy = self.busy_ids()
        for item in out.scheduled:
            sid = item.seq.seq_id
            if sid in self._free_after and sid not in busy:
                self._free_after.discard(sid)
                self.cache.free(sid)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> SchedulerOutput | None:
        """The newest step in flight (None when none is)."""
        return self.steps_in_flight[-1] if self.steps_in_flight else None

    def busy_ids(self) -> set[int]:
        """Sequence ids of the steps in flight: none of them is scheduled, preempted or advanced until its step's
        output is applied (a sequence is in at most one step in flight)."""
        return {item.seq.seq_id for out in self.steps_in_flight for item in out.scheduled}

    def _micro_batch_caps(self) -> tuple[int, int]:
        """(most running sequences, most sequences in all) one step takes: no limit with one step in flight; with
        ``max_in_flight`` steps (pipeline stages) an equal share of the running sequences, and of those that could
        run (running + waiting, at most ``max_num_seqs``), so that the next step finds sequences not in flight."""
        n = self.max_in_flight
        if n == 1 or self.async_scheduling:
            return self.config.max_num_seqs, self.config.max_num_seqs
        could_run = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-len(self.running) // n)), max(1, -(-could_run // n))

    def schedule(self) -> StepInput:
        """Build the next step (see the module docstring); kept in ``steps_in_flight`` until :meth:`update`.
        With ``max_in_flight`` > 1 (pipeline parallelism) up to that many steps are in flight at once; the
        sequences of those steps are left out of this one."""
        if len(self.steps_in_flight) >= self.max_in_flight:
            raise RuntimeError(f"schedule: {len(self.steps_in_flight)} steps are still in flight "
                               f"(at most {self.max_in_flight})")
        budget = self.config.max_num_batched_tokens
        run_cap, cap = self._micro_batch_caps()
        scheduled: list[ScheduledSeq] = []
        taken: set[int] = self.busy_ids()  # never preempted, never scheduled twice
        preempted: list[Sequence] = []

        ahead = self._ahead_ids()  # in the newest step in flight, scheduled again with a placeholder token
        decoding, prefilling = [], []  # running sequences not in flight (or ahead), past their prefill or not
        for s in self.running:
            if s.seq_id not in taken:
                (decoding if s.is_decoding else prefilling).append(s)
            elif s.seq_id in ahead and s.is_decoding:
                decoding.append(s)
        # the batch-size cut counts every decoding sequence, in flight or not (pipelined steps see a share each)
        speculate = (self.spec.config is not None
                     and self.spec.config.drafts_at(sum(1 for s in self.running if s.is_decoding)))
        for seq in decoding:
            if budget < 1 or len(scheduled) >= run_cap:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier sequence of this loop
                continue
            placeholder = seq.seq_id in ahead  # (its in-flight token is not in token_ids yet)
            if self._grow(seq, seq.num_computed_tokens + 1 + placeholder, taken, preempted):
                # blocks for drafts only while free (no preemption)
                drafts = self.spec.propose(seq, budget - 1) if speculate else []
                scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens + placeholder, 1 + len(drafts),
                                              is_prefill=False, drafts=drafts, placeholder=placeholder))
                taken.add(seq.seq_id)
                budget -= 1 + len(drafts)

        for seq in prefilling:
            if len(scheduled) >= run_cap:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            n = self._chunk(seq, budget)
            if n and self._grow(seq, seq.num_computed_tokens + n, taken, preempted):
                scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, is_prefill=True))
                taken.add(seq.seq_id)
                budget -= n

        passed_over = 0
        for seq in list(self.waiting):  # FIFO; only a sequence that chose to wait for a prefix is passed over
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or len(scheduled) >= cap:
                break
            if self._wait_for_prefix(seq):
                passed_over += 1
                if passed_over >= self.config.max_num_seqs:  # bound the scan of a long queue
                    break
                continue
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, is_prefill=True))
            taken.add(seq.seq_id)
            budget -= n

        for item in scheduled:  # after all admissions, so saves never take a slot a new sequence needed
            if item.is_prefill:
                item.saves = self.cache.plan_saves(
                    item.seq.seq_id,
                    item.seq.cache_key_ids,
                    item.start,
                    item.end,
                    last_chunk=item.end == item.seq.prefill_len,
                )
            elif item.drafts:
                self.spec.plan_slots(item)
            if item.is_prefill and item.start == self._publish_boundary(item.seq):
                self._publish(item.seq)
        copies = self.cache.take_copies()
        step = self._step_input(scheduled, copies)
        self.steps_in_flight.append(SchedulerOutput(scheduled=scheduled, copies=copies, preempted=preempted,
                                                    step=step))
        del self._finished_ids[:len(step.finished_request_ids)]  # now the step in flight carries them
        return step

    def _ahead_ids(self) -> set[int]:
        """Asynchronous scheduling: sequences the next step may decode before the newest step in flight returns
        their token: in no other step in flight, a plain sampled one-token decode there, running, with room for
        one more token under max_tokens, and no sampler state that needs the token on the host first (penalties,
        grammars, a thinking budget). The rest wait for their step's output."""
        if not self.async_scheduling or not self.steps_in_flight:
            return set()
        older = {item.seq.seq_id for out in list(self.steps_in_flight)[:-1] for item in out.scheduled}
        ids = set()
        for item in self.steps_in_flight[-1].scheduled:
            seq, p = item.seq, item.seq.sampling
            if (item.samples and not item.is_prefill and not item.drafts and item.num_new_tokens == 1
                    and seq.status is SequenceStatus.RUNNING and seq.seq_id not in older
                    and seq.num_tokens - seq.num_prompt_tokens + 2 <= seq.max_tokens
                    and (p is None or not (p.has_penalties or p.needs_logits_mask))):
                ids.add(seq.seq_id)
        return ids

    def update(self, output: StepOutput) -> list[RequestDelta]:
        """After the step ran on the workers: advance each sequence, index what it computed, append the sampled
        tokens, check the stop conditions and finish requests. Returns one delta per request that sampled."""
        out = self._take_in_flight(output.step_id)
        self.cache.finish_copies(out.copies)
        accepted_of = None  # built on the first verification chunk
        failed = set(output.kv_failed)
        if output.kv_bytes_received or output.kv_bytes_sent or output.kv_transfer_s:  # (a Counter: missing = 0)
            self.kv_stats.update(bytes_received=output.kv_bytes_received, bytes_sent=output.kv_bytes_sent,
                                 seconds=output.kv_transfer_s)
        finished = SequenceStatus.FINISHED
        gone = {item.seq.seq_id for item in out.scheduled if item.seq.status is finished}  # aborted while in flight
        for item in out.scheduled:
            seq = item.seq
            if seq.seq_id in gone or seq.request_id in failed:
                # gone: its cache is freed already, only the step's save slots go back; failed: its step ran on a
                # cache that did not arrive, nothing is kept
                self.cache.abandon_saves(item.saves)
                item.saves = []
                continue
            if seq.kv_loading:
                seq.kv_loading = False
                seq.kv_transfer_params = None
                self.kv_stats["loaded"] += 1
            if item.is_prefill:
                self.cache.commit_prefill(seq.seq_id, seq.cache_key_ids, item.end, item.saves)
            seq.num_computed_tokens = item.start + item.num_new_tokens
            if item.drafts:  # verified: keep the state after the last accepted token, give back the rest
                if accepted_of is None:
                    accepted_of = {t.request_id: t.accepted for t in output.sampled}
                accepted = accepted_of.get(item.seq.request_id, ())
                item.seq.num_computed_tokens = item.start + 1 + len(accepted)
                self.spec.settle(item, len(accepted))
        if output.prompt_logprobs:
            self._take_prompt_logprobs(out.scheduled, output)  # (an aborted sequence's are dropped with it)
        samplers = [item.seq for item in out.scheduled if item.samples]
        if len(samplers) != len(output.sampled):
            raise RuntimeError(f"step {output.step_id}: {len(output.sampled)} sampled tokens for "
                               f"{len(samplers)} sampling requests")
        deltas = []
        for seq, token in zip(samplers, output.sampled):
            if token.request_id != seq.request_id:
                raise RuntimeError(f"step {output.step_id}: sampled token of {token.request_id!r} where "
                                   f"{seq.request_id!r} was expected")
            if seq.request_id in failed or seq.seq_id in gone:
                continue
            if not token.accepted:  # no verified drafts (the common case): one token, no merge
                deltas.append(self._append(seq, token.token_id, token.logprobs, token.error))
                seq.proposal = (len(seq.token_ids), token.draft_token_ids)
                continue
            delta = None
            draft_logprobs = token.accepted_logprobs or (None,) * len(token.accepted)
            for draft, lp in zip(token.accepted, draft_logprobs):  # drafts first; a stop drops the rest
                delta = _merge(delta, self._append(seq, draft, lp, ""))
                if seq.is_finished:
                    break
            if not seq.is_finished:
                delta = _merge(delta, self._append(seq, token.token_id, token.logprobs, token.error))
                seq.proposal = (seq.num_tokens, token.draft_token_ids)
            deltas.append(delta)
        for item in out.scheduled if failed else ():
            if item.seq.request_id in failed:
                self._recompute_prompt(item.seq)
        self._free_deferred(out)
        return deltas

    @staticmethod
    def _take_prompt_logprobs(scheduled: list[ScheduledSeq], output: StepOutput) -> None:
        """Append the prompt log-probabilities the step computed (a recomputed prefill's repeats are skipped)."""
        by_id = {item.seq.request_id: item.seq for item in scheduled}
        for part in output.prompt_logprobs:
            seq = by_id.get(part.request_id)
            if seq is None or seq.prompt_logprobs is None:
                raise RuntimeError(f"step {output.step_id}: prompt logprobs of {part.request_id!r}, which did not "
                                   "ask for them this step")
            for i, (entry, rank) in enumerate(zip(part.entries, part.ranks)):
                if part.first + i == len(seq.prompt_logprobs) < seq.num_prompt_tokens:
                    seq.prompt_logprobs.append(dict(entry))
                    seq.prompt_logprob_ranks.append(rank)

    def _recompute_prompt(self, seq: Sequence) -> None:
        """A failed prompt-cache load (checksum mismatch, timeout, producer gone): back to the front of the queue
        to compute the prompt here; the workers drop and re-register the request (its sampling state saw this
        step's token). Not a preemption; counted as a transfer failure."""
        seq.kv_loading = False
        seq.kv_transfer_params = None
        self.kv_stats["failures"] += 1
        self._preempt(seq, count=False)
        if seq.known_to_workers:
            self._finished_ids.append(seq.request_id)
            seq.registered = seq.known_to_workers = False

    def checkpoint(self) -> UpdateCheckpoint:
        """What :meth:`update` of the oldest step in flight may change (see :meth:`roll_back`)."""
        if not self.steps_in_flight:
            raise RuntimeError("checkpoint: no step in flight")
        samplers = [(seq, len(seq.token_ids), None if seq.logprobs is None else len(seq.logprobs),
                     seq.stop.num_chars_emitted, seq.proposal)
                    for item in self.steps_in_flight[0].scheduled if item.samples for seq in (item.seq,)]
        return UpdateCheckpoint(list(self.running), len(self._finished_ids), samplers)

    def roll_back(self, checkpoint: UpdateCheckpoint) -> list[Sequence]:
        """Undo an :meth:`update` that an exception cut short: the sampling sequences get back their tokens, text,
        logprobs and running status (a request it finished is unfinished again), and the queue its order. The
        cache is not restored: the caller rebuilds it (:meth:`EngineCore.recover`). Returns those sequences."""
        self.steps_in_flight.clear()
        self.running[:] = checkpoint.running
        del self._finished_ids[checkpoint.num_finished_ids:]
        for seq, num_tokens, num_logprobs, emitted, proposal in checkpoint.samplers:
            del seq.token_ids[num_tokens:]
            if num_logprobs is not None:
                del seq.logprobs[num_logprobs:]
            seq.status, seq.finish_reason, seq.error = SequenceStatus.RUNNING, None, None
            seq.stop.rewind(seq.output_token_ids, emitted)
            seq.proposal = proposal
        return [seq for seq, *_ in checkpoint.samplers]

    def abandon(self, newest_only: bool = False) -> None:
        """The steps in flight failed on the workers (or never ran; ``newest_only``: only the newest, e.g. an
        empty one), newest first: unpin their copy sources, give back their save slots, and send their sequences
        back to the queue to be recomputed (their KDA slots may be half-updated). Cache entries published by
        earlier steps are untouched (a failed step only wrote private blocks and slots). Not a preemption."""
        while self.steps_in_flight:
            self._abandon(self.steps_in_flight.pop())
            if newest_only:
                return

    def _abandon(self, out: SchedulerOutput) -> None:
        self._finished_ids[:0] = out.step.finished_request_ids  # sent again (dropping twice is harmless)
        self.cache.finish_copies(out.copies)
        for item in out.scheduled:
            self.cache.abandon_saves(item.saves)
            item.saves = []
        for item in reversed(out.scheduled):
            item.seq.registered = False  # told again next time (a worker keeps a request it already knows)
            self._drop_load(item.seq)
            if item.seq.status is SequenceStatus.RUNNING:
                self._preempt(item.seq, count=False)
        self._free_deferred(out)

    def _drop_load(self, seq: Sequence) -> None:
        """A prompt-cache load in a step that never completed (the step failed, or the bookkeeping was rebuilt
        around it): the workers may have fetched it already and told the producer to free it, so the prompt is
        recomputed here (counted as ``abandoned``); its blocks and slot went back with the sequence's."""
        if seq.kv_loading:
            seq.kv_loading = False
            seq.kv_transfer_params = None
            self.kv_stats["abandoned"] += 1

    def restore(self, seqs: list[Sequence], *, num_preemptions: int, step_id: int, finished_ids: list[str]) -> None:
        """Queue ``seqs`` (unfinished requests of a previous scheduler, in order) on this fresh scheduler, to be
        recomputed from their prompts and outputs; the workers are told about them again (they keep known ones)."""
        if self.running or self.waiting or self.steps_in_flight:
            raise RuntimeError("restore: the scheduler is not fresh")
        self.num_preemptions, self.step_id, self._finished_ids = num_preemptions, step_id, list(finished_ids)
        for seq in seqs:
            self._drop_load(seq)  # a load not yet started is carried over: this connector starts it on admission
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = 0
            seq.admitted_this_step = False
            seq.blocks_sent = 0
            seq.registered = False
            self.waiting.append(seq)

    def take_finished_ids(self) -> list[str]:
        """Requests the workers know of that ended and were not yet told of (their worker state can be dropped),
        including those of a step in flight (it may never run)."""
        pending = [rid for out in self.steps_in_flight for rid in out.step.finished_request_ids]
        ids, self._finished_ids = list(dict.fromkeys([*pending, *self._finished_ids])), []
        return ids

    def return_finished_ids(self, ids: list[str] | tuple[str, ...]) -> None:
        """Give back ids :meth:`take_finished_ids` returned whose step never ran (they are sent again; dropping a
        request's worker state twice is harmless)."""
        self._finished_ids[:0] = [rid for rid in ids if rid not in self._finished_ids]

    # ---- step contract -------------------------------------------------------------------------------------
    def _step_input(self, scheduled: list[ScheduledSeq], copies: CopyPlan) -> StepInput:
        """The workers' view of the step: decodes first, new requests once, block-table deltas."""
        keys = [(item.is_prefill, bool(item.drafts)) for item in scheduled]
        if keys != sorted(keys):  # stable: one-token decodes first, then verifications, then prefills
            order = sorted(range(len(scheduled)), key=keys.__getitem__)
            scheduled[:] = [scheduled[i] for i in order]
        new_requests, chunks = [], []
        cache, take_moved, moved = self.cache, self.spec.take_moved, self.spec.num_tracked() > 0
        for item in scheduled:
            seq = item.seq
            if not seq.registered:
                needs_prompt = seq.sampling is not None and (seq.sampling.repetition_penalty != 1
                                                             or seq.sampling.prompt_logprobs is not None)
                new_requests.append(NewRequest(seq.request_id, seq.sampling, seq.num_prompt_tokens,
                                               tuple(seq.prompt_token_ids) if needs_prompt else ()))
                seq.registered = seq.known_to_workers = True
            table = cache.table(seq.seq_id)
            admitted = seq.admitted_this_step
            sent = 0 if admitted else seq.blocks_sent
            images = tuple(im for im in seq.images if im.pad_end > item.start) if admitted and seq.images else ()
            if item.placeholder:  # the token sampled by the step in flight, taken on the device
                token_ids = (PLACEHOLDER_TOKEN,)
            elif item.drafts:
                token_ids = tuple(seq.token_ids[item.start : item.end - len(item.drafts)]) + tuple(item.drafts)
            elif item.num_new_tokens == 1:
                token_ids = (seq.token_ids[item.start],)
            else:
                token_ids = tuple(seq.token_ids[item.start : item.end])
            chunks.append(ScheduledChunk(
                request_id=seq.request_id, token_ids=token_ids, from_previous=item.placeholder,
                start=item.start, num_draft=len(item.drafts), slot_moved=take_moved(seq.seq_id) if moved else False,
                admitted=admitted, block_ids=tuple(table[sent:]) if sent < len(table) else (),
                kda_slot=cache.slot(seq.seq_id),
                is_prefill=item.is_prefill, sample=item.samples, saves=tuple(item.saves) if item.saves else (),
                images=images,
                prompt_logprob_rows=max(0, min(item.end, seq.num_prompt_tokens - 1) - item.start)
                if item.is_prefill and seq.needs_prompt_logprobs else 0,
            ))
            seq.blocks_sent = len(table)
            seq.admitted_this_step = False
        self.step_id += 1
        meta = None if self.connector is None else self.connector.build_connector_meta()
        return StepInput(
            step_id=self.step_id, new_requests=tuple(new_requests), chunks=tuple(chunks),
            num_decodes=sum(not item.is_prefill and not item.drafts for item in scheduled),
            block_copies=tuple(copies.block_copies), state_copies=tuple(copies.state_copies),
            finished_request_ids=tuple(self._finished_ids),
            kv_connector_meta=meta if meta is not None and (meta.loads or meta.saves) else None,
        )

    def _take_in_flight(self, step_id: int) -> SchedulerOutput:
        """The oldest step in flight, which ``step_id`` must be (outputs are applied in step order)."""
        out = self.steps_in_flight[0] if self.steps_in_flight else None
        if out is None or out.step.step_id != step_id:
            expected = None if out is None else out.step.step_id
            raise RuntimeError(f"update: step {step_id} is not the oldest step in flight ({expected})")
        self.steps_in_flight.popleft()
        return out

    def _append(self, seq: Sequence, token: int, logprobs: tuple[tuple[int, float], ...] | None,
                error: str) -> RequestDelta:
        """One sampled token of a running sequence: append it, check stops, finish when done."""
        first = len(seq.token_ids) == len(seq.prompt_token_ids)  # the first delta carries the prompt logprobs
        prompt_lp = (seq.prompt_logprobs, seq.prompt_logprob_ranks) if first else (None, None)
        if error:
            self.finish(seq, "error")
            seq.error = error
            return RequestDelta(seq.request_id, [], "", None, True, "error", error,
                                self._output(seq), *prompt_lp)
        seq.token_ids.append(token)
        entry = None
        if logprobs is not None:
            entry = dict(logprobs)
            if seq.logprobs is not None:
                seq.logprobs.append(entry)
        stop = seq.stop
        reason = stop.push(token).finish_reason
        if reason is None:
            return RequestDelta(seq.request_id, [token], stop.take_text_delta(), None if entry is None else [entry],
                                False, seq.finish_reason, None, None, *prompt_lp)
        self.finish(seq, reason)
        return RequestDelta(seq.request_id, [token], stop.take_text_delta(), None if entry is None else [entry],
                            True, seq.finish_reason, None, self._output(seq), *prompt_lp)

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        return RequestOutput(list(seq.prompt_token_ids), seq.output_token_ids, seq.stop.text, seq.logprobs,
                             seq.finish_reason or "abort", seq.error, seq.num_cached_tokens, seq.prompt_logprobs,
                             seq.prompt_logprob_ranks, kv_transfer_params=seq.kv_params_out)

    # ---- helpers -------------------------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of the next prefill chunk: the rest of the prefill if it fits, else up to the last aligned
        position within the budget (0 when none is reachable this step). A chunk never takes more than the
        config's ``prefill_chunk_cap`` (``--long-prefill-token-threshold``)."""
        budget = min(budget, self.config.prefill_chunk_cap)
        start = seq.num_computed_tokens
        boundary = self._publish_boundary(seq)
        end = boundary if boundary is not None and start < boundary else seq.prefill_len
        remaining = end - start
        if remaining <= budget:
            return remaining
        end = (start + budget) // self.alignment * self.alignment
        return max(0, end - start)

    def _wait_for_prefix(self, seq: Sequence) -> bool:
        """With prefix caching, a waiting sequence whose prompt shares at least one more aligned stretch with a
        prefill in flight (running, or admitted earlier in this step) than the cache can serve now stays queued
        until that prefill has saved its states, instead of computing the same prefix side by side. The prefill
        it waits for is running and advances every step, so the wait is bounded."""
        if not self.cache.caching or seq.needs_prompt_logprobs:
            return False
        limit = seq.num_tokens - 1  # one token is always computed
        shared = 0
        key = seq.cache_key_ids
        for other in self.running:
            if not other.is_decoding:
                shared = max(shared, _common_prefix(key, other.cache_key_ids, min(limit, other.prefill_len)))
        reachable = shared // self.alignment * self.alignment
        return reachable > 0 and reachable > self.cache.match_length(key)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admit the head of the queue with its first chunk; 0 (nothing held) if it cannot run this step. When
        the longest hit does not fit (its copy-on-write pins one block more), a hit on whole blocks is tried."""
        seq.prefill_len = seq.num_tokens
        for whole_blocks in (False, True):
            cached = self.cache.admit(seq.seq_id, seq.cache_key_ids, reuse=not seq.needs_prompt_logprobs,
                                      whole_blocks=whole_blocks)
            if cached is None:
                continue
            remote = 0  # prompt tokens a prefill instance computed for this request (loaded in this step)
            if self.connector is not None and seq.kv_transfer_params and seq.prefill_len == seq.num_prompt_tokens \
                    and not seq.needs_prompt_logprobs:  # prompt logprobs need the prompt computed here
                remote, _ = self.connector.get_num_new_matched_tokens(seq.request_id, seq.num_prompt_tokens, cached,
                                                                     seq.kv_transfer_params)
            seq.num_computed_tokens = cached + remote
            seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            seq.admitted_this_step = True
            n = self._chunk(seq, budget)
            if n and self.cache.ensure_capacity(seq.seq_id, cached + remote + n):
                if remote:
                    self.connector.update_state_after_alloc(seq.request_id, tuple(self.cache.table(seq.seq_id)),
                                                            self.cache.slot(seq.seq_id), remote)
                    seq.kv_loading = True
                return n
            if remote:
                self.connector.update_state_after_alloc(seq.request_id, (), None, 0)  # forget the pending load
            self.cache.cancel_admission(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.num_cached_tokens = 0
            seq.status = SequenceStatus.WAITING
            seq.admitted_this_step = False
            if cached % self.cache.block_size == 0:  # no copy-on-write to leave out
                return 0
        return 0

    def _publish_boundary(self, seq: Sequence) -> int | None:
        """A kv_producer's request asked to publish its prompt (``do_remote_decode``): the position N - 1 whose
        state is published (its prefill stops there once, so the running slot holds that state when the chunk of
        the last prompt token starts); None otherwise."""
        if self.connector is None or not self.connector.config.is_producer:
            return None
        n = seq.num_prompt_tokens
        if n < 2 or seq.prefill_len != n or not wants_remote_decode(seq.kv_transfer_params):
            return None
        return n - 1

    def _publish(self, seq: Sequence) -> None:
        """Publish the MLA pages of the first N - 1 prompt tokens and the running KDA slot (the state after them)
        in this step, before its forward computes the last prompt token."""
        n = seq.num_prompt_tokens - 1
        blocks = tuple(self.cache.table(seq.seq_id)[: -(-n // self.config.cache.block_size)])
        self.connector.add_save(ReqTransfer(seq.request_id, seq.request_id, blocks, self.cache.slot(seq.seq_id), n))
        self.kv_stats["published"] += 1

    def _grow(self, seq: Sequence, num_tokens: int, taken: set[int], preempted: list[Sequence]) -> bool:
        """Cover ``num_tokens`` positions of ``seq``, preempting the newest unscheduled running sequences
        (possibly ``seq`` itself) while blocks are short. False if ``seq`` cannot run this step."""
        while not self.cache.ensure_capacity(seq.seq_id, num_tokens):
            victim = next((s for s in reversed(self.running) if s.seq_id not in taken), None)
            if victim is None:
                return False
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self.spec.forget(seq.seq_id)
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        if count:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def retire(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished (it holds no cache any more) and tell the workers to drop it."""
        self.spec.forget(seq.seq_id)
        if self.connector is not None:
            self.connector.forget(seq.request_id)
        if self.connector is not None and reason not in ("abort", "error") and \
                wants_remote_decode(seq.kv_transfer_params):
            _, seq.kv_params_out = self.connector.request_finished(seq.request_id, (), None,
                                                                   max(0, seq.num_prompt_tokens - 1))
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.known_to_workers:  # also after an abandoned step reset ``registered``
            self._finished_ids.append(seq.request_id)


def _merge(first: RequestDelta | None, then: RequestDelta) -> RequestDelta:
    """One delta for the tokens a verification step added to a request (``then`` happened after ``first``)."""
    if first is None:
        return then
    logprobs = None if first.new_logprobs is None and then.new_logprobs is None else \
        [*(first.new_logprobs or []), *(then.new_logprobs or [])]
    return dataclasses.replace(then, new_token_ids=first.new_token_ids + then.new_token_ids,
                               new_text=first.new_text + then.new_text, new_logprobs=logprobs)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    step = 64
    i = 0
    while i < n and a[i : i + step] == b[i : i + step]:  # compare in slices: fast on long shared prefixes
        i += step
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
