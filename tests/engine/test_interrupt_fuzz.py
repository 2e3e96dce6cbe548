"""An exception at EVERY bookkeeping point of the engine, one point per run (issue #31 item 7): not a sample.

A point is each line executed in the engine core, the scheduler, the sequences, the stop checks, the detokenizer,
the speculative planner and the cache modules (block pool, KDA slots, prefix index, manager), plus each call of a
callback (the tokenizer's ``token_bytes``, the executor's ``execute``). Two small workloads cover what users turn
on together: chunked prefill, prefix hits with copy-on-write, a preemption out of a small pool and evicted blocks
and saved states ("prefix"); an abort, a stop string, a stop token, length limits and an abort of a request that
already finished ("stops"). A reference run counts a workload's N points; run k (k = 1..N) raises at point k,
once. The engine runs over the tensor-free simulator (tests/cache_sim.py), which checks every read of the shadow
cache, so a point costs milliseconds.

After the exception the user recovers as an application does: with a KeyboardInterrupt, as ``LLM.generate``
does (abort every request it still waits for, then go on with new ones); with an exception from a callback, by
stepping on. Right after the exception and at the end, every block and KDA slot must be free (or cached and
evictable) or held by a live request, the scheduler's queues must hold exactly the engine's live requests, and
the workers must have been told of every request that ended. Every request that finished must have streamed
exactly its final tokens and text, and those must be the cache-free reference's.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import sys

import pytest

from rocm_k3.cache.invariants import check_invariants
from rocm_k3.sampling_params import SamplingParams
from tests.cache_sim import LetterTokenizer, Request, SimEngine, SimExecutor, reference_outputs, small_config

FILES = ("rocm_k3/engine/core.py", "rocm_k3/engine/scheduler.py", "rocm_k3/engine/sequence.py",
         "rocm_k3/engine/stop.py", "rocm_k3/engine/outputs.py", "rocm_k3/tokenizers/detokenizer.py",
         "rocm_k3/cache/", "rocm_k3/spec_decode/")
CALLBACKS = (LetterTokenizer.token_bytes.__code__, SimExecutor.execute.__code__)
VOCAB = 23  # token t is the letter chr(97 + t)
STOP_TOKEN = 12
MAX_ITERATIONS = 100
BASE = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


@dataclasses.dataclass
class Workload:
    """Requests (arriving / aborted at iterations of the user's loop) on an engine of ``num_blocks`` blocks of 8
    tokens and ``num_slots`` KDA slots; ``abort_finished``: (request, iteration) of an abort after it finished."""

    requests: list[Request]
    num_blocks: int
    num_slots: int
    budget: int = 16
    abort_finished: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        self.want = reference_outputs(self.requests, vocab=VOCAB, stop_token=STOP_TOKEN)
        letters = LetterTokenizer()
        self.want_text = {r.request_id: min((letters.decode(self.want[r.request_id]).split(s)[0] for s in r.stop),
                                            key=len, default=letters.decode(self.want[r.request_id]))
                          for r in self.requests}
        self.params = {r.request_id: SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True,
                                                    stop_token_ids=(STOP_TOKEN,), stop=r.stop)
                       for r in self.requests}
        scripted = [r.arrival_step for r in self.requests] + [r.abort_step or 0 for r in self.requests]
        self.last_scripted = max(scripted + [self.abort_finished[1] if self.abort_finished else 0])


WORKLOADS = {
    "prefix": Workload([
        Request("a", BASE + [11, 12], 4),  # two prefill chunks (budget 16); saves states at 8, 16 and 20
        Request("b", BASE + [13], 4, arrival_step=1),  # waits for a's first chunk, then hits 16 tokens
        Request("f", BASE + [19], 2, arrival_step=4),  # hits a's state at 20: copy-on-write of a partial block
    ], num_blocks=4, num_slots=4),  # 4 blocks of 8: a preemption, evicted blocks and states
    "stops": Workload([
        Request("c", BASE[:9] + [14, 15], 7, abort_step=2),
        Request("d", [16, 17, 18], 4),  # [22, 16, 3, 12]: the stop token
        Request("e", [7, 7, 2], 10, arrival_step=1, stop=("fq",)),  # text "hsifq": stops after 5 tokens at "hsi"
    ], num_blocks=6, num_slots=4, abort_finished=("d", 5)),
}


class Injected(Exception):
    """Stands for an exception escaping a callback (tokenizer, executor) or a bug inside the bookkeeping."""


class Probe:
    """sys.settrace function counting bookkeeping points from ``count``; raises ``exc`` at point ``fire_at``
    (never when -1). CPython turns tracing off when a trace function raises, so the rest runs untraced."""

    def __init__(self, fire_at: int, exc: type[BaseException], count: int = 0) -> None:
        self.fire_at, self.exc, self.count = fire_at, exc, count
        self.raised: BaseException | None = None
        self.where = ""

    def __call__(self, frame, event, arg):
        if frame.f_code in CALLBACKS:
            self._point(frame)
            return None
        path = frame.f_code.co_filename.replace(os.sep, "/")
        return self._line if any(f in path for f in FILES) else None

    def _line(self, frame, event, arg):
        if event == "line":
            self._point(frame)
        return self._line

    def _point(self, frame) -> None:
        self.count += 1
        if self.count == self.fire_at:
            path = frame.f_code.co_filename.replace(os.sep, "/")
            self.where = f"{path.rsplit('/rocm_k3/', 1)[-1].rsplit('/tests/', 1)[-1]}:{frame.f_lineno} " \
                         f"({frame.f_code.co_name})"
            self.raised = self.exc(f"injected at point {self.count}: {self.where}")
            raise self.raised


class User:
    """Runs a workload through the engine as an application would and records what each request streamed."""

    def __init__(self, work: Workload, abort_on_interrupt: bool, check_every_step: bool = False) -> None:
        cfg = small_config(caching=True, block=8, unit=4, align=8, budget=work.budget, max_seqs=3, max_len=40)
        self.eng = SimEngine(cfg, num_blocks=work.num_blocks, num_slots=work.num_slots, vocab=VOCAB,
                             tokenizer=LetterTokenizer())
        self.core = self.eng.core
        self.work = work
        self.abort_on_interrupt = abort_on_interrupt
        self.check_every_step = check_every_step
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.outputs = {}
        self.aborted: set[str] = set()
        self.iteration = 0

    def run(self, probe: Probe | None, traced_from: int, starts: list[int] | None = None) -> None:
        """Iterate the workload; ``probe`` traces from iteration ``traced_from`` on (``starts`` records the point
        count at the start of each iteration); an exception it raised is recovered from and checked."""
        while self.iteration < MAX_ITERATIONS:
            if starts is not None:
                starts.append(probe.count)
            if self.iteration > self.work.last_scripted and not self.core.has_unfinished():
                return
            if probe is not None and probe.raised is None and self.iteration >= traced_from:
                sys.settrace(probe)
            try:
                self._iterate()
            except (KeyboardInterrupt, Injected) as exc:
                sys.settrace(None)
                if probe is None or exc is not probe.raised:
                    raise
                self._recover(probe.where)
                continue  # the iteration is done again (what succeeded in it is not repeated)
            finally:
                sys.settrace(None)
            self.iteration += 1
        raise AssertionError(f"the workload did not finish in {MAX_ITERATIONS} iterations")

    def _iterate(self) -> None:
        i = self.iteration
        for r in self.work.requests:
            rid = r.request_id
            if r.arrival_step <= i and rid not in self.tokens:
                self.eng.executor.truth[rid] = list(r.prompt)
                self.core.add_request(rid, r.prompt, self.work.params[rid])
                self.tokens[rid], self.text[rid] = [], ""
            if r.abort_step is not None and r.abort_step <= i and rid not in self.aborted | set(self.outputs):
                self._abort(rid, "")
        late = self.work.abort_finished
        if late is not None and i == late[1] and late[0] in self.outputs:
            assert not self.core.abort(late[0]), "abort of a finished request"
        if self.core.has_unfinished():
            self._deliver(self.core.step())
        if self.check_every_step:
            tracer, _ = sys.gettrace(), sys.settrace(None)  # the test's checks are no bookkeeping points
            self.eng.check()
            sys.settrace(tracer)

    def _abort(self, rid: str, where: str) -> None:
        """Abort ``rid``; False is right only when an abort that an exception cut short did it already."""
        if not self.core.abort(rid):
            assert rid not in self.core._seqs, f"{where}: abort of live request {rid} returned False"
        assert rid not in self.core._seqs, f"{where}: {rid} still live after its abort"
        self.aborted.add(rid)

    def _deliver(self, deltas) -> None:
        for d in deltas:
            assert d.request_id not in self.outputs, f"{d.request_id}: a delta after its final one"
            self.tokens[d.request_id] += d.new_token_ids
            self.text[d.request_id] += d.new_text
            if d.finished:
                self.outputs[d.request_id] = d.output

    def _recover(self, where: str) -> None:
        assert_owned_or_free(self.core, where)
        # the simulated worker's record of each request follows the engine's (a step's dropped tokens are redone)
        for rid, seq in self.core._seqs.items():
            self.eng.executor.truth[rid] = list(seq.token_ids)
        if self.abort_on_interrupt:  # what LLM.generate does: abort every request it still waits for
            for rid in self.tokens:
                if rid not in self.outputs and rid not in self.aborted:
                    self._abort(rid, where)
            assert not self.core._seqs and not self.core.has_unfinished(), where
            assert_owned_or_free(self.core, where)

    def check_end(self, where: str) -> None:
        assert_owned_or_free(self.core, where)
        st = self.core.stats()
        assert st["free_blocks"] == st["num_blocks"] and st["free_state_slots"] == st["num_state_slots"], \
            f"{where}: pinned at the end: {st['free_blocks']}/{st['num_blocks']} blocks, " \
            f"{st['free_state_slots']}/{st['num_state_slots']} KDA slots free"
        told = set(self.core.scheduler.take_finished_ids())  # what the next step would tell the workers
        kept = set(self.eng.executor.tables) - told
        assert not kept, f"{where}: the workers were never told that {sorted(kept)} ended"
        want, want_text = self.work.want, self.work.want_text
        for rid, out in self.outputs.items():
            assert self.tokens[rid] == out.token_ids == want[rid], \
                f"{where}: {rid} streamed {self.tokens[rid]}, returned {out.token_ids}, expected {want[rid]}"
            assert self.text[rid] == out.text == want_text[rid], \
                f"{where}: {rid} streamed text {self.text[rid]!r}, returned {out.text!r}, expected {want_text[rid]!r}"
        for rid in self.aborted:
            assert rid not in self.outputs and self.tokens[rid] == want[rid][:len(self.tokens[rid])], \
                f"{where}: aborted {rid} streamed {self.tokens[rid]}"
        expected = {r.request_id for r in self.work.requests} - self.aborted
        assert set(self.outputs) == expected, f"{where}: finished {sorted(self.outputs)}, expected {sorted(expected)}"


def assert_owned_or_free(core, where: str) -> None:
    """No step in flight; every sequence the cache or the scheduler holds is a live request of the engine, and
    every live request is queued once; the cache's counts and pins are consistent (check_invariants)."""
    sched, mgr = core.scheduler, core.cache_manager
    live = core._seqs
    assert sched.in_flight is None, f"{where}: a step is still in flight"
    finished = [rid for rid, s in live.items() if s.is_finished]
    assert not finished, f"{where}: finished requests still registered: {finished}"
    queued = [s.request_id for s in [*sched.running, *sched.waiting]]
    assert sorted(queued) == sorted(live), f"{where}: queued {sorted(queued)}, live {sorted(live)}"
    stray = set(mgr.seqs) - {s.seq_id for s in sched.running}
    assert not stray, f"{where}: cache held by sequences that are not running: {stray}"
    check_invariants(mgr, {s.seq_id: s.num_computed_tokens for s in sched.running}, between_steps=True)


def _reference_run(work: Workload) -> tuple[list[int], User]:
    """Point counts at the start of each iteration of an uninterrupted run (and the run, to check coverage)."""
    user, starts = User(work, abort_on_interrupt=False, check_every_step=True), []
    user.run(Probe(-1, Injected), 0, starts)
    return starts, user


def test_the_workloads_reach_every_path_and_stream_the_reference() -> None:
    for name, work in WORKLOADS.items():
        starts, user = _reference_run(work)
        user.check_end(f"{name}: reference run")
        assert starts[-1] > 2000, (name, starts[-1])  # the points the fuzz test covers
        st = user.core.stats()
        if name == "prefix":
            assert st["hit_requests"] >= 2 and st["cow_copies"] >= 1 and st["preemptions"] >= 1, st
            assert st["state_evictions"] >= 1 and st["block_evictions"] >= 1, st
            assert len(work.requests[0].prompt) > work.budget  # a's prefill takes two chunks
        else:
            reasons = {rid: o.finish_reason for rid, o in user.outputs.items()}
            assert reasons == {"d": "stop", "e": "stop"} and user.aborted == {"c"}, reasons
            assert user.outputs["e"].text == "hsi" and user.outputs["d"].token_ids[-1] == STOP_TOKEN


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("exc", [KeyboardInterrupt, Injected], ids=["ctrl_c_then_abort", "callback_error_then_go_on"])
def test_an_exception_at_every_bookkeeping_point_pins_nothing(exc, name, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="rocm_k3.engine")  # one "bookkeeping rebuilt" warning per point
    work = WORKLOADS[name]
    starts, _ = _reference_run(work)
    total = starts[-1]
    failures = []
    for k in range(1, total + 1):
        first = bisect.bisect_left(starts, k) - 1  # the iteration in which point k lies
        user = User(work, abort_on_interrupt=exc is KeyboardInterrupt)
        probe = Probe(k, exc, count=starts[first])
        try:
            user.run(probe, first)
            assert probe.raised is not None, f"point {k} was not reached"
            user.check_end(f"point {k} ({probe.where})")
        except AssertionError as e:
            failures.append(str(e))
        except Exception as e:  # noqa: BLE001 (reported with the point)
            failures.append(f"point {k} ({probe.where}): {type(e).__name__}: {e}")
    assert not failures, f"{len(failures)} of {total} points:\n" + "\n".join(failures[:30])
