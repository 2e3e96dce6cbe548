"""A tensor-free engine simulator for scheduler/cache tests (test support, not part of the package): the real
EngineCore driving a simulated worker through the step contract.

The shadow "KV cache" stores the token id written at each (block, offset) and each shadow "KDA slot" stores the
token prefix its state summarises. Before every simulated forward the simulator checks that each scheduled
sequence reads exactly its own prefix through its block table and its slot, so any wrong sharing, missing
copy-on-write or stale state shows up as a mismatch. The next token is a fixed function of the whole prefix.
"""

from __future__ import annotations

import dataclasses

from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.invariants import check_invariants
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.core import EngineCore
from rocm_k3.engine.scheduler import SchedulerOutput
from rocm_k3.engine.sequence import Sequence
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.step_io import SampledToken, StepInput, StepOutput


def next_token(prefix: tuple[int, ...], vocab: int) -> int:
    """Deterministic 'model': an integer hash of the whole prefix (independent of any cache)."""
    h = 1469598103934665603
    for t in prefix:
        h = ((h ^ t) * 1099511628211) % (1 << 61)
    return h % vocab


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    abort_step: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (need the engine's LetterTokenizer)


class LetterTokenizer:
    """Token t decodes to the letter ``chr(97 + t)`` (a vocabulary of at most 26): text for stop strings."""

    special_tokens: dict[str, int] = {}

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < 26:
            raise ValueError(f"token id {token_id} outside the letter vocabulary")
        return bytes([97 + token_id])

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode()


class SimExecutor:
    """A worker that keeps shadow pools and checks every read against the true prefix (see the module docstring).

    It sees only the step contract (StepInput in, StepOutput out), exactly like a real worker; the true token
    prefix of each request is the prompt it was registered with plus the tokens this worker sampled for it.
    """

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, vocab: int) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.state: list[tuple[int, ...] | None] = [None] * num_slots
        self.truth: dict[str, list[int]] = {}  # request id -> prompt + sampled tokens
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self.on_execute = None  # called with each StepInput before it runs (the engine's view of the step)

    def execute(self, step: StepInput) -> StepOutput:
        if self.on_execute is not None:
            self.on_execute(step)
        for rid in step.finished_request_ids:
            self.tables.pop(rid, None)
            self.slots.pop(rid, None)
        for src, dst, n in step.block_copies:
            self.kv[dst][:n] = self.kv[src][:n]
        for src, dst in step.state_copies:
            self.state[dst] = self.state[src]
        sampled = []
        for chunk in step.chunks:
            rid = chunk.request_id
            if chunk.admitted:
                self.tables[rid] = list(chunk.block_ids)
                self.slots[rid] = chunk.kda_slot
            else:
                self.tables[rid] += chunk.block_ids
            table, slot, truth = self.tables[rid], self.slots[rid], self.truth[rid]
            start, end = chunk.start, chunk.end
            if list(chunk.token_ids) != truth[start:end]:
                raise AssertionError(f"{rid}: step sends tokens {chunk.token_ids}, expected {truth[start:end]}")
            if len(table) * self.block_size < end:
                raise AssertionError(f"{rid}: table of {len(table)} blocks cannot hold {end} tokens")
            for pos in range(start):  # the context the model reads
                got = self.kv[table[pos // self.block_size]][pos % self.block_size]
                if got != truth[pos]:
                    raise AssertionError(f"{rid}: KV at position {pos} holds {got}, expected {truth[pos]}")
            if start > 0 and self.state[slot] != tuple(truth[:start]):
                raise AssertionError(f"{rid}: KDA slot {slot} does not hold the state after {start} tokens")
            for pos in range(start, end):
                self.kv[table[pos // self.block_size]][pos % self.block_size] = truth[pos]
            self.state[slot] = tuple(truth[:end])
            for pos, save_slot in chunk.saves:
                if not start < pos <= end:
                    raise AssertionError(f"save position {pos} outside chunk ({start}, {end}]")
                self.state[save_slot] = tuple(truth[:pos])
            if chunk.sample:
                if end != len(truth):
                    raise AssertionError(f"{rid}: samples after {end} tokens but {len(truth)} are known")
                tok = next_token(tuple(truth), self.vocab)
                truth.append(tok)
                sampled.append(SampledToken(rid, tok))
        return StepOutput(step.step_id, tuple(sampled))


class SimEngine:
    """EngineCore (the real scheduler, cache manager, stop checks and recovery) over a :class:`SimExecutor`."""

    def __init__(
        self, config: EngineConfig, num_blocks: int, num_slots: int, vocab: int = 50, stop_token: int | None = None,
        tokenizer: LetterTokenizer | None = None,
    ):
        self.executor = SimExecutor(num_blocks, num_slots, config.cache.block_size, vocab)
        geometry = config.cache.geometry(num_blocks=num_blocks, num_slots=num_slots,
                                         max_model_len=config.max_model_len)
        self.core = EngineCore(config, self.executor, geometry=geometry, vocab_size=10**9, tokenizer=tokenizer)
        self.block_size = config.cache.block_size
        self.vocab = vocab
        self.stop_token = stop_token
        self.seqs: dict[str, Sequence] = {}
        self.computed_prefill_tokens = 0
        self.steps = 0
        self._last: SchedulerOutput | None = None
        self.executor.on_execute = self._record

    @property
    def sched(self):
        return self.core.scheduler

    @property
    def cache(self):
        return self.core.cache_manager

    def _record(self, step: StepInput) -> None:
        self._last = self.core.scheduler.in_flight

    def add(self, req: Request) -> Sequence:
        stops = () if self.stop_token is None else (self.stop_token,)
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, stop_token_ids=stops, ignore_eos=True,
                                stop=req.stop)
        self.executor.truth[req.request_id] = list(req.prompt)
        self.core.add_request(req.request_id, req.prompt, params)
        seq = self.core._seqs[req.request_id]
        self.seqs[req.request_id] = seq
        return seq

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def step(self) -> SchedulerOutput:
        self._last = None
        self.core.step()
        out = self._last
        self.computed_prefill_tokens += sum(it.num_new_tokens for it in out.scheduled if it.is_prefill)
        self.check()
        self.steps += 1
        return out

    def check(self) -> None:
        live = {s.seq_id: s.num_computed_tokens for s in self.sched.running}
        check_invariants(self.cache, live, between_steps=True)

    def run(self, requests: list[Request], max_steps: int = 10_000) -> dict[str, list[int]]:
        pending = sorted(requests, key=lambda r: r.arrival_step)
        step = 0
        while pending or self.sched.has_unfinished():
            while pending and pending[0].arrival_step <= step:
                self.add(pending.pop(0))
            for r in requests:
                if r.abort_step == step and r.request_id in self.seqs:
                    self.abort(r.request_id)
            if self.sched.has_unfinished():
                self.step()
            step += 1
            if step > max_steps:
                raise AssertionError("simulation did not finish")
        return {rid: s.output_token_ids for rid, s in self.seqs.items()}


def reference_outputs(requests: list[Request], vocab: int = 50, stop_token: int | None = None) -> dict[str, list[int]]:
    """What each request must produce, computed without any engine (stop strings over LetterTokenizer's text)."""
    out = {}
    letters = LetterTokenizer()
    for r in requests:
        toks = list(r.prompt)
        gen: list[int] = []
        while len(gen) < r.max_tokens:
            t = next_token(tuple(toks), vocab)
            toks.append(t)
            gen.append(t)
            if t == stop_token or (r.stop and any(s in letters.decode(gen) for s in r.stop)):
                break
        out[r.request_id] = gen
    return out


def small_config(
    caching: bool = True,
    block: int = 8,
    unit: int = 4,
    align: int = 8,
    budget: int = 32,
    max_seqs: int = 4,
    max_len: int = 64,
) -> EngineConfig:
    return EngineConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        cache=CacheConfig(
            block_size=block,
            match_unit=unit,
            alignment=align,
            kda_save_grid=1,
            enable_prefix_caching=caching,
            num_blocks=1,
            num_state_slots=1,
        ),
    )
