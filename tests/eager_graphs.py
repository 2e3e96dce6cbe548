"""A CPU stand-in for captured decode graphs: :class:`EagerGraphs` keeps every buffer, layout, fixed stage input,
receive, send and gather of :class:`~rocm_k3.worker.cuda_graph.DecodeGraphs` and 'records' each (bucket, width)
as a forward run eagerly at replay time over the same static buffers, its results copied into the output
tensors of the first run (as a replay rewrites the graph's outputs in place)."""

from __future__ import annotations

import torch

from rocm_k3.model.attn_res import StackState
from rocm_k3.worker.cuda_graph import DecodeGraphs
from rocm_k3.worker.stage_link import state_parts


def _parts(out: torch.Tensor | StackState) -> list[torch.Tensor]:
    return state_parts(out) if isinstance(out, StackState) else [out]


class EagerReplay:
    """One 'graph': ``run()`` once now (its outputs and tapped rows are the persistent ones), again per replay."""

    def __init__(self, run, taps) -> None:
        self.run, self.taps = run, taps
        self.out = run()
        self.tapped = taps.tapped if taps is not None and taps.tap_layers else None

    @torch.inference_mode()
    def replay(self) -> None:
        new = self.run()
        for dst, src in zip(_parts(self.out), _parts(new)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        if self.tapped is not None:
            self.tapped.copy_(self.taps.tapped)
            self.taps.tapped = self.tapped


class EagerGraphs(DecodeGraphs):
    """Every (bucket, width) 'captured' as an eager forward over the graphs' buffers (see the module docstring)."""

    def _record(self, batch, state):
        graph = EagerReplay(lambda: self.model.run(batch, self.pools, state), self.taps)
        return graph, graph.out
