"""The worker's half of ``draft_model`` speculation: drafts for the next step from this step's tapped states.

The target model taps the drafter's depths at its logits rows (``KimiModel.tap_layers`` -> ``tapped``
[R, taps, hidden]). After acceptance, each sampling chunk's last accepted row (a plain chunk: its one row; a
verification: row ``len(accepted)``, the position whose target token ended the chunk) and that token start the
drafter, which proposes ``num_speculative_tokens`` tokens; they travel back in ``SampledToken.draft_token_ids``
and the scheduler verifies them in the next step (trimmed to what max_tokens, max_model_len and free blocks
allow). Failed rows get no drafts; requests with penalties or grammars get them like any other (their rows are
processed ahead over the drafts, see ``spec_decode.acceptance``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rocm_k3.spec_decode.config import SpeculativeConfig
from rocm_k3.spec_decode.drafter import TapDrafter, load_drafter
from rocm_k3.worker.step_io import SampledToken, ScheduledChunk


class DraftProposer:
    """Binds a drafter to the target ``model`` (sets its tapped depths) and proposes after each step."""

    def __init__(self, drafter: TapDrafter, model, num_speculative_tokens: int) -> None:
        self.drafter = drafter
        self.model = model
        self.k = num_speculative_tokens
        model.tap_layers = drafter.cfg.tap_layer_ids

    @classmethod
    def for_model(cls, config: SpeculativeConfig, model) -> DraftProposer:
        cfg = model.cfg
        drafter = load_drafter(config.model, target_hidden_size=cfg.hidden_size,
                               target_num_hidden_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                               device=model.device, revision=config.revision)
        return cls(drafter, model, config.num_speculative_tokens)

    def attach(self, chunks: Sequence[ScheduledChunk], sampled: Sequence[SampledToken]) -> tuple[SampledToken, ...]:
        """``sampled`` (one per sampling chunk) with the drafts of the next step attached (the tapped rows are in
        :func:`~rocm_k3.spec_decode.acceptance.expand_rows` order)."""
        rows, firsts, which = [], [], []
        row = 0
        for i, (c, tok) in enumerate(zip(chunks, sampled)):
            if not tok.error:
                rows.append(row + len(tok.accepted))
                firsts.append(tok.token_id)
                which.append(i)
            row += 1 + c.num_draft
        out = list(sampled)
        if not rows or self.model.tapped is None:
            return tuple(out)
        dev = self.model.tapped.device
        taps = self.model.tapped[torch.tensor(rows, device=dev)]  # [B, taps, hidden]
        drafts = self.drafter.propose(taps, torch.tensor(firsts, dtype=torch.int64, device=dev), self.k).tolist()
        for i, d in zip(which, drafts):
            out[i] = dataclasses.replace(out[i], draft_token_ids=tuple(d))
        return tuple(out)
