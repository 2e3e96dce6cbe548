"""DataParallelEngine: DP attention with expert-parallel MoE (``--data-parallel-size N``), behind the EngineCore API.

N replicas, each an :class:`~rocm_k3.engine.core.EngineCore` with its own scheduler and cache manager, share one
multi-process executor of N x TP ranks: attention / KDA / dense layers are replicated per replica (TP inside it),
the MoE layers form one expert-parallel group over all ranks. A new request goes to the replica with the fewest
requests in flight (ties: the lowest index). :meth:`DataParallelEngine.step` schedules every replica, runs their
steps together in one executor command (a replica with nothing to run sits the step out: its ranks run every MoE
layer with zero tokens, so the others' all-to-alls complete and its experts serve their rows), then commits each
replica's output. Nothing waits unboundedly: every rank runs every command, and the collectives are bounded by
``--distributed-timeout``.

``LLM``, ``AsyncLLM`` and the server use it as they use an EngineCore (add_request, abort, step, stats, ...).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from rocm_k3.engine.core import EngineCore
from rocm_k3.engine.guard import InterruptGuard
from rocm_k3.engine.outputs import RequestDelta
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.step_io import ImageInput, StepInput

RATIOS = {"hit_rate": ("hit_tokens", "query_tokens"), "spec_acceptance_rate": ("spec_num_accepted_tokens",
                                                                              "spec_num_draft_tokens")}


class DataParallelEngine:
    """See the module docstring. ``cores``: one EngineCore per replica, each over a
    :class:`~rocm_k3.executor.replicas.ReplicaExecutor` of ``executor`` (the shared MultiprocExecutor)."""

    def __init__(self, cores: Seq[EngineCore], executor: Any) -> None:
        if len(cores) < 2 or not all(isinstance(c, EngineCore) for c in cores):
            raise TypeError(f"cores: expected two or more EngineCores, got {cores!r}")
        self.cores = list(cores)
        self.executor = executor
        self.guard = InterruptGuard()
        for core in self.cores:  # one guard: nested sections defer a Ctrl-C to the outermost
            core.guard = self.guard
        self.num_steps = 0
        self._undelivered: list[RequestDelta] = []  # committed by a step that then raised: returned next

    # ---- what the front ends read --------------------------------------------------------------------------
    @property
    def config(self):
        return self.cores[0].config

    @property
    def geometry(self):
        return self.cores[0].geometry

    @property
    def vocab_size(self) -> int:
        return self.cores[0].vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.cores[0].eos_token_ids

    @property
    def tokenizer(self) -> Any:
        return self.cores[0].tokenizer

    @property
    def accepts_images(self) -> bool:
        return self.cores[0].accepts_images

    @property
    def data_parallel_size(self) -> int:
        return len(self.cores)

    # ---- requests ------------------------------------------------------------------------------------------
    def replica_of(self, request_id: str) -> int | None:
        """The replica holding ``request_id`` (queued or running), or None."""
        return next((d for d, core in enumerate(self.cores) if core.has_request(request_id)), None)

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    images: Seq[ImageInput] = ()) -> None:
        """Queue the request on the replica with the fewest requests in flight (see EngineCore.add_request)."""
        if isinstance(request_id, str) and self.replica_of(request_id) is not None:
            raise ValueError(f"request_id {request_id!r} is already in use")
        replica = min(range(len(self.cores)), key=lambda d: (self.cores[d].num_requests, d))
        self.cores[replica].add_request(request_id, prompt_token_ids, params, images=images)

    def abort(self, request_id: str) -> bool:
        replica = self.replica_of(request_id)
        return False if replica is None else self.cores[replica].abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._undelivered) or any(core.has_unfinished() for core in self.cores)

    # ---- one step ------------------------------------------------------------------------------------------
    def check_workers(self) -> None:
        self.executor.check_alive()

    def step(self) -> list[RequestDelta]:
        """One lockstep step of every replica; the deltas of all of them (see EngineCore.step). When an exception
        escapes, the replicas not yet committed are abandoned (their requests recomputed); deltas already
        committed come with the next call."""
        deltas, self._undelivered = self._undelivered, []
        steps: list[Any] = []
        try:
            for core in self.cores:
                steps.append(core.begin_step())
            if all(s is None for s in steps):
                return deltas
            for d, core in enumerate(self.cores):  # a replica sitting out still tells its ranks what finished
                finished = core.take_finished_ids() if steps[d] is None else ()
                if finished:
                    steps[d] = StepInput(step_id=-1, finished_request_ids=finished)
            outputs = self.executor.execute_replicas(tuple(steps))
        except BaseException:
            for core, step in zip(self.cores, steps):
                core.abandon_step()
                if step is not None and not step.chunks and step.finished_request_ids:  # told with a later step
                    core.return_finished_ids(step.finished_request_ids)
            self._undelivered = deltas
            raise
        self.num_steps += 1
        for i, (core, step, output) in enumerate(zip(self.cores, steps, outputs)):
            if step is None or not step.chunks:
                continue
            try:
                deltas += core.finish_step(step, output)
            except BaseException:
                for later in self.cores[i + 1:]:
                    later.abandon_step()
                self._undelivered = deltas
                raise
        return deltas

    run_to_completion = EngineCore.run_to_completion  # step until every queued request finished (any replica)

    # ---- counters ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """EngineCore.stats summed over the replicas (ratios recomputed from the sums; ``steps`` counts lockstep
        steps), plus ``data_parallel_size`` and per replica ``replica{d}_running`` / ``replica{d}_waiting``."""
        per = [core.stats() for core in self.cores]
        out: dict[str, float] = {}
        for s in per:
            for key, value in s.items():
                out[key] = out.get(key, 0) + value
        for key, (num, den) in RATIOS.items():
            if key in out:
                out[key] = out.get(num, 0) / out[den] if out.get(den) else 0.0
        drafts = out.get("spec_num_drafts", 0)
        if "spec_mean_accepted_length" in out:
            out["spec_mean_accepted_length"] = 1 + out.get("spec_num_accepted_tokens", 0) / drafts if drafts else 0.0
        for key in [k for k in out if k.startswith("spec_acceptance_rate_pos")]:
            n = out.get("spec_num_accepted_tokens_pos" + key.removeprefix("spec_acceptance_rate_pos"), 0)
            out[key] = n / drafts if drafts else 0.0
        out["steps"] = self.num_steps
        out["data_parallel_size"] = len(self.cores)
        for d, s in enumerate(per):
            for key in ("running", "waiting"):
                out[f"replica{d}_{key}"] = s[key]
        return out

    def expert_loads(self, reset: bool = False) -> dict[int, list[int]]:
        """Picks per logical expert of each MoE layer, summed over the replicas (TP rank 0 of each counts its
        replica's routing)."""
        out: dict[int, list[int]] = {}
        for r in self.executor.rank_stats(reset):
            if r["tp_rank"] != 0:
                continue
            for layer, loads in r.get("expert_load", {}).items():
                have = out.setdefault(int(layer), [0] * len(loads))
                out[int(layer)] = [a + int(b) for a, b in zip(have, loads)]
        return dict(sorted(out.items()))
