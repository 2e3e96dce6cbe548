"""One pipeline stage's forward, with the hand-off to its neighbours (point-to-point over the PP group).

``StageLink.forward(batch, cache)`` has the model's signature: a single-stage model just runs; under pipeline
parallelism a stage receives the previous stage's :class:`~rocm_k3.model.attn_res.StackState` (running sum, last
MLP output and, with AttnRes, the whole block bank), runs its layers and sends the state on; only the last stage
returns logits (the others return None). Every rank of a stage sends to / receives from the rank with the same
TP rank in the neighbouring stage (NCCL/RCCL point-to-point on GPUs, gloo on the CPU).

The sends are asynchronous (``isend``): a stage hands its state on and starts the next micro-batch while the next
stage receives (``irecv`` of every part, then a wait). A sent state is kept alive until its send completed; at
most ``pp_size`` sends stay open (the oldest is waited for first), and :meth:`StageLink.drain` waits for all.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from rocm_k3.distributed.context import ParallelContext
from rocm_k3.model.attn_res import StackState
from rocm_k3.model.forward_batch import ForwardBatch, HybridCacheView


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
        ctx = self.ctx
        if ctx.pp_size == 1:
            return self.model.forward_stage(batch, cache, None)
        state = None if ctx.is_first_stage else self._recv(batch.num_tokens)
        out = self.model.forward_stage(batch, cache, state)
        if ctx.is_last_stage:
            return out
        self._send(out)
        return None

    def _tensors(self, state: StackState) -> list[torch.Tensor]:
        parts = [state.running, state.delta]
        if state.blocks is not None:
            parts.append(state.blocks)
        return parts

    def _send(self, state: StackState) -> None:
        dst = self.ctx.pp_ranks[self.ctx.pp_rank + 1]
        self.ctx.count("pp_send")
        tensors = [t.contiguous() for t in self._tensors(state)]
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

    def _recv(self, num_tokens: int) -> StackState:
        src = self.ctx.pp_ranks[self.ctx.pp_rank - 1]
        parts = [torch.empty(shape, dtype=self.dtype, device=self.device)
                 for shape in self.model.state_shapes(num_tokens)]
        works = [dist.irecv(t, src, group=self.ctx.pp_group) for t in parts]
        for w in works:
            w.wait()
        return StackState(parts[0], parts[1], parts[2] if len(parts) > 2 else None)
