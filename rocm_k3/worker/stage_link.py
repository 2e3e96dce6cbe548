"""One pipeline stage's forward, with the hand-off to its neighbours (point-to-point over the PP group).

``StageLink.forward(batch, cache)`` has the model's signature: a single-stage model just runs; under pipeline
parallelism a stage receives the previous stage's :class:`~rocm_k3.model.attn_res.StackState` (running sum, last
MLP output and, with AttnRes, the whole block bank), runs its layers and sends the state on; only the last stage
returns logits (the others return None). Every rank of a stage sends to / receives from the rank with the same
TP rank in the neighbouring stage (NCCL/RCCL point-to-point on GPUs, gloo on the CPU).

The three parts are separate so a decode graph can hold only the middle one (:class:`~rocm_k3.worker.cuda_graph.
DecodeGraphs`): :meth:`recv` (into new tensors) or :meth:`recv_into` (into a graph's fixed input buffers,
:class:`StateBuffers`), :meth:`run` (the stage's layers: no communication between stages), :meth:`send`.

The sends are asynchronous (``isend``): a stage hands its state on and starts the next micro-batch while the next
stage receives (``irecv`` of every part, then a wait). A sent state is kept alive until its send completed; at
most ``pp_size`` sends stay open (the oldest is waited for first), and :meth:`StageLink.drain` waits for all.
A graph's output tensors are rewritten by its next replay, so :meth:`send` with ``copy=True`` sends a copy of
them (made on the compute stream, in order after the replay that wrote them).
"""

from __future__ import annotations

import collections
import math

import torch
import torch.distributed as dist

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.attn_res import StackState
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView


def state_parts(state: StackState) -> list[torch.Tensor]:
    """The tensors a stage boundary carries, in wire order: running, delta (and the AttnRes bank)."""
    parts = [state.running, state.delta]
    if state.blocks is not None:
        parts.append(state.blocks)
    return parts


def state_of(parts: list[torch.Tensor]) -> StackState:
    """The inverse of :func:`state_parts`."""
    return StackState(parts[0], parts[1], parts[2] if len(parts) > 2 else None)


class StateBuffers:
    """Fixed device buffers a stage's decode graphs read their input state from: one flat buffer per part, sized
    for ``max_tokens`` rows. :meth:`view` gives the state of ``num_tokens`` rows as contiguous views of the
    buffers' starts (the same memory for every row count: one graph replays at a time on a stage, and a receive
    into the buffers is ordered after the replay before it on the device)."""

    def __init__(self, shapes_of, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
        self._shapes_of = shapes_of  # num_tokens -> the part shapes
        self.max_tokens = max_tokens
        self._flat = [torch.zeros(math.prod(s), dtype=dtype, device=device) for s in shapes_of(max_tokens)]

    def view(self, num_tokens: int) -> StackState:
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"view: {num_tokens} rows, the buffers hold 1 .. {self.max_tokens}")
        return state_of([flat[: math.prod(s)].view(s) for flat, s in zip(self._flat, self._shapes_of(num_tokens))])


class StageLink:
    def __init__(self, model, ctx: ParallelContext) -> None:
        self.model = model
        self.ctx = ctx
        self.cfg = model.cfg
        self._sends: collections.deque[tuple[list, list[torch.Tensor]]] = collections.deque()  # (works, tensors)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, batch: ForwardBatch, cache: HybridCacheView) -> torch.Tensor | None:
        """Receive (after the first stage), run, send (before the last stage): logits on the last stage, else
        None."""
        out = self.run(batch, cache, self.recv(batch.num_tokens))
        if self.ctx.is_last_stage:
            return out
        self.send(out)
        return None

    def run(self, batch: ForwardBatch, cache: HybridCacheView,
            state: StackState | None) -> torch.Tensor | StackState:
        """This stage's layers from ``state`` (None on the first stage: from the token ids): logits fp32 [N,
        vocab] on the last stage, else the state to send on. No communication between stages."""
        return self.model.forward_stage(batch, cache, state)

    def input_buffers(self, max_tokens: int) -> StateBuffers | None:
        """Fixed input buffers for graphs of up to ``max_tokens`` rows; None on the first stage (it starts from
        the token ids)."""
        if self.ctx.is_first_stage:
            return None
        return StateBuffers(self.model.state_shapes, max_tokens, self.dtype, self.device)

    def send(self, state: StackState, copy: bool = False) -> None:
        """Start sending ``state`` to the next stage (``copy``: send a copy, the tensors are a graph's output)."""
        dst = self.ctx.pp_ranks[self.ctx.pp_rank + 1]
        self.ctx.count("pp_send")
        tensors = [t.clone() if copy else t.contiguous() for t in state_parts(state)]
        works = []
        for t in tensors:
            self.ctx.add("collective_bytes", t.numel() * t.element_size())
            works.append(dist.isend(t, dst, group=self.ctx.pp_group))
        self._sends.append((works, tensors))
        while len(self._sends) > self.ctx.pp_size:  # bound the states held for open sends
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        works, _ = self._sends.popleft()
        for w in works:
            w.wait()

    def drain(self) -> None:
        """Wait until every send this stage started has completed."""
        while self._sends:
            self._wait_oldest()

    def recv(self, num_tokens: int) -> StackState | None:
        """The previous stage's state of a step of ``num_tokens`` rows, in new tensors; None on the first stage."""
        if self.ctx.is_first_stage:
            return None
        state = state_of([torch.empty(shape, dtype=self.dtype, device=self.device)
                          for shape in self.model.state_shapes(num_tokens)])
        self.recv_into(state)
        return state

    def recv_into(self, state: StackState) -> None:
        """Receive the previous stage's state into the (contiguous) tensors of ``state`` and wait for it."""
        src = self.ctx.pp_ranks[self.ctx.pp_rank - 1]
        works = [dist.irecv(t, src, group=self.ctx.pp_group) for t in state_parts(state)]
        for w in works:
            w.wait()
