"""Structured output and thinking budgets on the worker: per-request grammar state and the per-step token masks.

A request whose :class:`~rocm_k3.sampling_params.SamplingParams` has ``structured_outputs`` or a
``thinking_token_budget`` gets a :class:`RequestConstraint` when it registers on the worker. The grammar comes
from one :class:`~rocm_k3.structured.StructuredCompiler` over the checkpoint's own tokenizer, built lazily when the
first such request arrives (an unconstrained server never imports xgrammar), with the output family the engine
was configured with. The grammar itself compiles on a compile thread from registration on (cached per constraint);
a request that thinks first never waits for it, one that needs its mask at once waits in its first step (bench:
~1 s for a 5-property schema at K3's vocabulary, then cached). Each step:

1. ``constraint.confirm(tokens)``: the output tokens the engine confirmed (``request_state``) advance the grammar
   (or, while the request still thinks, its reasoning gate and budget count);
2. :meth:`StructuredSampling.start` fills the bitmask rows of the step's constrained sampling rows on a helper
   thread, so the work overlaps the forward pass (on a GPU the forward's kernels are queued asynchronously; on the
   CPU the fill runs while torch ops release the GIL);
3. the returned :class:`PendingMask`'s processor waits for the fill and applies the mask to the logits on their
   device (xgrammar's kernel) before sampling: disallowed tokens become -inf in those rows only, so unconstrained
   batch mates sample exactly as alone.

A request over its thinking budget that is still inside think gets the think-close marker forced token by token
(a one-token mask); the gate then sees the marker and the grammar starts. Failures are per request, never per
step: a spec that does not compile, a checkpoint without a tokenizer or output family, or a token the grammar
rejects set ``constraint.error`` and the worker finishes that request with finish reason "error".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.worker.sampler import LogitsProcessor

log = logging.getLogger("rocm_k3.worker")


@dataclasses.dataclass
class GrammarTimings:
    """Where the grammar's time went (seconds, summed over steps): compile (per new request, on the compile
    thread), compile_wait (a fill waiting for a compile: a request that needs its mask before its grammar is
    ready), confirm (gate steps), fill (accept + bitmask rows, on the helper thread, compile_wait included), wait
    (the sampler waiting for the fill after the forward: the part not overlapped), apply (mask -> logits on the
    device)."""

    steps: int = 0
    rows: int = 0
    compile_s: float = 0.0
    compile_wait_s: float = 0.0
    confirm_s: float = 0.0
    fill_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0


class RequestConstraint:
    """One request's grammar (or None) and thinking budget.

    gate: watches the output for the end of reasoning (None when the prompt did not end inside think); it
    decides the budget count and when the grammar starts. grammar: a future of the request's GrammarState,
    compiled on the compile thread; confirmed tokens wait in ``_pending`` until it is ready, so a request that
    thinks first never waits for its compile. forced: the think-close marker as token ids.
    """

    def __init__(self, params: SamplingParams, grammar: concurrent.futures.Future | None = None, gate: Any = None,
                 forced: tuple[int, ...] = (), error: str = "", timings: GrammarTimings | None = None) -> None:
        self.budget = params.thinking_token_budget
        self._timings = timings
        self.gate = gate
        self.forced = forced
        self.error = error
        self.num_thinking = 0  # confirmed output tokens while inside think
        self._future = grammar
        self._grammar = None
        self._pending: list[int] = []

    @property
    def in_think(self) -> bool:
        return self.gate is not None and not self.gate.is_open

    @property
    def has_grammar(self) -> bool:
        return self._future is not None

    def confirm(self, tokens: Sequence[int]) -> None:
        """Advance by the tokens the engine confirmed; a token the grammar rejects sets ``error``."""
        for tok in tokens:
            if self.in_think:
                self.num_thinking += 1
                self.gate.step(tok)
            self._pending.append(tok)
        if self._future is None:
            self._pending.clear()
        elif self._future.done():
            self.grammar()

    def grammar(self):
        """The GrammarState, caught up with every confirmed token (waits for the compile); None after an error."""
        if self.error or self._future is None:
            return None
        from rocm_k3.structured import GrammarRejectedError

        if self._grammar is None:
            t0 = time.perf_counter()
            try:
                self._grammar = self._future.result()
                if self._timings is not None:
                    self._timings.compile_wait_s += time.perf_counter() - t0
            except ValueError as exc:
                self.error = f"structured_outputs: {exc}"
                return None
        try:
            for tok in self._pending:
                self._grammar.accept(tok)
        except GrammarRejectedError as exc:
            self.error = f"structured output: {exc}"
            return None
        finally:
            self._pending.clear()
        return self._grammar

    def forced_token(self) -> int | None:
        """The token the budget forces next (inside think, budget spent), else None."""
        if self.budget is None or not self.in_think or self.num_thinking < self.budget:
            return None
        k = self.num_thinking - self.budget
        return self.forced[k] if k < len(self.forced) else None

    def needs_mask(self) -> bool:
        """Whether this step's row is constrained (a forced token, or the grammar applies now)."""
        if self.error:
            return False
        if self.forced_token() is not None:
            return True
        if self._future is None or self.in_think:
            return False
        return self._grammar is None or not self._grammar.is_terminated

    @property
    def speculates(self) -> bool:
        """Whether rows after drafts can be masked ahead: once the request is past think (the grammar alone
        decides). While it thinks, its reasoning gate and budget count are not simulated ahead (a draft may close
        think and start the grammar), so only the first row of a verification is used."""
        return not self.error and not self.in_think

    def fill(self, bitmask: torch.Tensor, row: int, ahead: Sequence[int] = ()) -> bool:
        """Write this step's allowed tokens into ``bitmask[row]``, as they are after the drafts ``ahead`` (a
        verification row); False when the row is unconstrained now (or unreachable)."""
        if not self.needs_mask() or (ahead and not self.speculates):
            return False
        forced = self.forced_token()
        if forced is not None:
            bitmask[row].zero_()
            bit = 1 << (forced % 32)
            bitmask[row, forced // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 bit pattern
            return True
        grammar = self.grammar()
        return grammar is not None and grammar.fill_bitmask_ahead(bitmask, row, ahead)


class PendingMask:
    """The masks of one step, being filled on the helper thread. ``processor`` waits for them and applies them."""

    def __init__(self, owner: StructuredSampling, future: concurrent.futures.Future, bitmask: torch.Tensor) -> None:
        self._owner = owner
        self._future = future
        self._bitmask = bitmask

    def wait(self) -> list[int]:
        """The rows that were filled (after the fill finished)."""
        t0 = time.perf_counter()
        rows = self._future.result()
        self._owner.timings.wait_s += time.perf_counter() - t0
        return rows

    def processor(self, start: int = 0) -> LogitsProcessor:
        """``start``: the first token of the logits' vocabulary slice (a vocab-parallel LM head)."""

        def apply(logits: torch.Tensor) -> None:
            from rocm_k3.structured import apply_bitmask

            rows = self.wait()
            t0 = time.perf_counter()
            apply_bitmask(logits, self._bitmask, rows, start)
            self._owner.timings.apply_s += time.perf_counter() - t0

        return apply


class StructuredSampling:
    """The worker's grammar side (see the module docstring).

    model_path: where the tokenizer is loaded from; family: the output family ("kimi_k3" / "kimi_k2", None = the
    checkpoint has none: constrained requests fail with a named error); vocab_size: the logits width.
    """

    def __init__(self, model_path: Path, family: str | None, vocab_size: int) -> None:
        self.model_path = Path(model_path)
        self.family = family
        self.vocab_size = vocab_size
        self.timings = GrammarTimings()
        self._compiler = None
        self._compiler_error = ""
        self._forced: tuple[int, ...] = ()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # fills
        self._compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None
        self._lock = threading.Lock()

    # ---- requests ------------------------------------------------------------------------------------------
    def new_constraint(self, params: SamplingParams) -> RequestConstraint:
        """The constraint of a registering request (never raises: a failure becomes the constraint's error)."""
        compiler = self._get_compiler()
        if compiler is None:
            return RequestConstraint(params, error=self._compiler_error)
        from rocm_k3.structured import ReasoningGate

        spec = params.structured_outputs
        gate = None
        if params.prompt_in_think:  # the same gate the grammar state uses, so both see think end together
            tool_calls = spec is None or spec.kind == "tools"
            gate = ReasoningGate(compiler.tokenizer, compiler.tokens, tool_calls=tool_calls)
        grammar = None
        if spec is not None:
            if self._compile_pool is None:
                self._compile_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="rocm-k3-grammar-compile")
            # the grammar's own gate stays closed while the prompt ends in think: it sees the same tokens
            grammar = self._compile_pool.submit(self._compile, compiler, spec, params.prompt_in_think)
        return RequestConstraint(params, grammar=grammar, gate=gate, forced=self._forced, timings=self.timings)

    def _compile(self, compiler, spec, prompt_in_think: bool):
        t0 = time.perf_counter()
        state = compiler.new_state(spec, thinking=prompt_in_think, prompt_in_think=prompt_in_think)
        self.timings.compile_s += time.perf_counter() - t0
        return state

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None and not self._compiler_error:
                try:
                    self._compiler, self._forced = self._build_compiler()
                except (ValueError, TypeError, OSError, ImportError) as exc:
                    self._compiler_error = f"structured output is unavailable for {self.model_path}: {exc}"
                    log.error("%s", self._compiler_error)
            return self._compiler

    def _build_compiler(self):
        from rocm_k3.formats.parsers import kimi_k2, kimi_k3
        from rocm_k3.structured import StructuredCompiler
        from rocm_k3.tokenizers import load_tokenizer

        if self.family is None:
            raise ValueError("the checkpoint has no output family (pass --tool-call-parser / --reasoning-parser)")
        tokenizer = load_tokenizer(self.model_path)
        if tokenizer is None:
            raise ValueError("the checkpoint has no tokenizer this package can read")
        t0 = time.perf_counter()
        compiler = StructuredCompiler(tokenizer, self.family, vocab_size=self.vocab_size)
        log.info("grammar compiler for %s (%s, V=%d) built in %.0f ms", self.model_path, self.family,
                 self.vocab_size, (time.perf_counter() - t0) * 1e3)
        close = kimi_k3.THINK_CLOSE if self.family == "kimi_k3" else kimi_k2.THINK_CLOSE
        forced: list[int] = []
        for piece in compiler.tokens.pieces(close):
            forced.extend([piece] if isinstance(piece, int) else tokenizer.encode(piece))
        return compiler, tuple(forced)

    # ---- one step ------------------------------------------------------------------------------------------
    def start(self, constraints: Sequence[RequestConstraint | None],
              ahead: Sequence[Sequence[int]] | None = None) -> PendingMask | None:
        """Start filling the masks of a step's sampling rows (row i: ``constraints[i]``, after the drafts
        ``ahead[i]``); None when no row needs one now."""
        if not any(c is not None and c.needs_mask() for c in constraints):
            return None
        n = len(constraints)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            from rocm_k3.structured import allocate_bitmask

            self._bitmask = allocate_bitmask(max(n, 2 * (0 if self._bitmask is None else self._bitmask.shape[0])),
                                             self.vocab_size)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rocm-k3-grammar")
        bitmask = self._bitmask[:n]
        self.timings.steps += 1
        ahead = list(ahead) if ahead is not None else [()] * n
        return PendingMask(self, self._pool.submit(self._fill, list(constraints), ahead, bitmask), bitmask)

    def _fill(self, constraints: list[RequestConstraint | None], ahead: list[Sequence[int]],
              bitmask: torch.Tensor) -> list[int]:
        t0 = time.perf_counter()
        rows = [i for i, c in enumerate(constraints) if c is not None and c.fill(bitmask, i, ahead[i])]
        self.timings.fill_s += time.perf_counter() - t0
        self.timings.rows += len(rows)
        return rows

    def close(self) -> None:
        for pool in (self._pool, self._compile_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._compile_pool = None
