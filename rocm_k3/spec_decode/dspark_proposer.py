"""The worker's half of ``draft_model`` speculation with a K3 DSpark drafter (:mod:`rocm_k3.spec_decode.dspark`).

The target taps the residual streams after the drafter's ``target_layer_ids`` at every token row of a step
(``KimiModel.tap_outputs``: ``tapped`` [T, taps, hidden] in chunk order). After acceptance, each chunk's rows that
stand (a prefill or decode chunk: all; a verification: the confirmed token and the accepted drafts) become the
request's drafter context: every draft layer's latent keys at those positions. A chunk that starts at or before
positions already held replaces them (a rejected draft's position is recomputed by the next verification; a
preempted request restarts from 0). Then each sampling chunk's token (the anchor, at the position after the last
standing row) starts one block of ``num_speculative_tokens`` drafts. A request whose prefix came from the prefix
cache has no context for the cached positions (the target did not run them): it drafts from what it has, which
only lowers acceptance; the verification keeps outputs exact either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rocm_k3.spec_decode.dspark import DSparkDrafter
from rocm_k3.worker.step_io import SampledToken, ScheduledChunk


@dataclasses.dataclass
class _Context:
    keys: torch.Tensor  # [L, C, R + P] every draft layer's latent keys
    positions: torch.Tensor  # int64 [C], ascending

    def keep_before(self, start: int) -> None:
        n = int(torch.searchsorted(self.positions, torch.tensor(start, device=self.positions.device)))
        self.keys, self.positions = self.keys[:, :n], self.positions[:n]


class DSparkProposer:
    """Binds a DSpark drafter to the target ``model`` (its taps, embedding and LM head) and proposes after each
    step; holds each running request's drafter context until :meth:`drop`."""

    def __init__(self, drafter: DSparkDrafter, model, num_speculative_tokens: int) -> None:
        self.drafter = drafter
        self.model = model
        self.k = num_speculative_tokens
        self.contexts: dict[str, _Context] = {}
        model.tap_layers = drafter.cfg.target_layer_ids
        model.tap_outputs = True

    def drop(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)

    def _extend(self, request_id: str, taps: torch.Tensor, start: int) -> None:
        positions = torch.arange(start, start + taps.shape[0], device=taps.device)
        keys = self.drafter.context(taps, positions)  # [L, n, R + P]
        ctx = self.contexts.get(request_id)
        if ctx is None:
            self.contexts[request_id] = _Context(keys, positions)
            return
        ctx.keep_before(start)
        ctx.keys, ctx.positions = torch.cat([ctx.keys, keys], dim=1), torch.cat([ctx.positions, positions])

    def attach(self, chunks: Sequence[ScheduledChunk], sampled: Sequence[SampledToken]) -> tuple[SampledToken, ...]:
        """``sampled`` (one per sampling chunk of ``chunks``, the step's chunks in order) with the drafts of the
        next step attached."""
        tapped = self.model.tapped  # [T, taps, hidden]
        total = sum(c.num_tokens for c in chunks)
        out = list(sampled)
        if tapped is None or tapped.shape[0] != total:
            raise RuntimeError(f"DSpark drafting: the target tapped {None if tapped is None else tapped.shape[0]} "
                               f"rows, the step ran {total} tokens")
        anchors: list[tuple[int, str, int, int]] = []  # (index in sampled, request, anchor token, its position)
        row = index = 0
        for c in chunks:
            standing = c.num_tokens
            if c.sample:
                tok = sampled[index]
                if tok.error:
                    standing = 0
                    self.drop(c.request_id)
                else:
                    standing = c.num_tokens - c.num_draft + len(tok.accepted)
                    anchors.append((index, c.request_id, tok.token_id, c.start + standing))
                index += 1
            if standing:
                self._extend(c.request_id, tapped[row : row + standing], c.start)
            row += c.num_tokens
        embed, head = self.model.embed, self.model.lm_head
        for i, rid, anchor, position in anchors:
            drafts = self.drafter.propose(self.contexts[rid].keys, anchor, position, self.k, embed, head)
            out[i] = dataclasses.replace(out[i], draft_token_ids=tuple(drafts))
        return tuple(out)
