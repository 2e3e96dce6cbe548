"""A tensor-free engine simulator for scheduler/cache tests (test support, not part of the package).

The shadow "KV cache" stores the token id written at each (block, offset) and each shadow "KDA slot" stores the
token prefix its state summarises. Before every simulated forward the simulator checks that each scheduled
sequence reads exactly its own prefix through its block table and its slot, so any wrong sharing, missing
copy-on-write or stale state shows up as a mismatch. The next token is a fixed function of the whole prefix.
"""

from __future__ import annotations

import dataclasses

from rocm_k3.cache.config import CacheConfig
from rocm_k3.cache.invariants import check_invariants
from rocm_k3.cache.manager import CacheManager
from rocm_k3.engine.config import EngineConfig
from rocm_k3.engine.scheduler import Scheduler, SchedulerOutput
from rocm_k3.engine.sequence import Sequence


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


class SimEngine:
    def __init__(
        self, config: EngineConfig, num_blocks: int, num_slots: int, vocab: int = 50, stop_token: int | None = None
    ):
        self.cache = CacheManager(config.cache, num_blocks, num_slots)
        self.sched = Scheduler(config, self.cache)
        self.block_size = config.cache.block_size
        self.vocab = vocab
        self.stop_token = stop_token
        self.kv: list[list[int | None]] = [[None] * self.block_size for _ in range(num_blocks)]
        self.state: list[tuple[int, ...] | None] = [None] * num_slots
        self.seqs: dict[str, Sequence] = {}
        self.computed_prefill_tokens = 0
        self.steps = 0

    def add(self, req: Request) -> Sequence:
        seq = Sequence(
            seq_id=len(self.seqs), request_id=req.request_id, prompt_token_ids=req.prompt, max_tokens=req.max_tokens
        )
        self.sched.add(seq)
        self.seqs[req.request_id] = seq
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs[request_id]
        if not seq.is_finished:
            self.sched.abort(seq)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._run(out)
        self.sched.postprocess(out)
        for item in out.scheduled:
            seq = item.seq
            if item.is_prefill:
                self.computed_prefill_tokens += item.num_new_tokens
            if item.samples:
                tok = next_token(tuple(seq.token_ids), self.vocab)
                seq.token_ids.append(tok)
                if len(seq.output_token_ids) >= seq.max_tokens or tok == self.stop_token:
                    self.sched.finish(seq, "length" if tok != self.stop_token else "stop")
        self.check()
        self.steps += 1
        return out

    def check(self) -> None:
        live = {s.seq_id: s.num_computed_tokens for s in self.sched.running}
        check_invariants(self.cache, live, between_steps=True)

    def _run(self, out: SchedulerOutput) -> None:
        for src, dst, n in out.copies.block_copies:
            self.kv[dst][:n] = self.kv[src][:n]
        for src, dst in out.copies.state_copies:
            self.state[dst] = self.state[src]
        for item in out.scheduled:
            seq, start, end = item.seq, item.start, item.end
            table = self.cache.table(seq.seq_id)
            slot = self.cache.slot(seq.seq_id)
            if len(table) * self.block_size < end:
                raise AssertionError(f"{seq.request_id}: table of {len(table)} blocks cannot hold {end} tokens")
            for pos in range(start):  # the context the model reads
                got = self.kv[table[pos // self.block_size]][pos % self.block_size]
                if got != seq.token_ids[pos]:
                    raise AssertionError(
                        f"{seq.request_id}: KV at position {pos} holds {got}, expected {seq.token_ids[pos]}"
                    )
            if start > 0 and self.state[slot] != tuple(seq.token_ids[:start]):
                raise AssertionError(f"{seq.request_id}: KDA slot {slot} does not hold the state after {start} tokens")
            for pos in range(start, end):
                self.kv[table[pos // self.block_size]][pos % self.block_size] = seq.token_ids[pos]
            self.state[slot] = tuple(seq.token_ids[:end])
            for pos, save_slot in item.saves:
                if not start < pos <= end:
                    raise AssertionError(f"save position {pos} outside chunk ({start}, {end}]")
                self.state[save_slot] = tuple(seq.token_ids[:pos])

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
    """What each request must produce, computed without any engine."""
    out = {}
    for r in requests:
        toks = list(r.prompt)
        gen: list[int] = []
        while len(gen) < r.max_tokens:
            t = next_token(tuple(toks), vocab)
            toks.append(t)
            gen.append(t)
            if t == stop_token:
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
