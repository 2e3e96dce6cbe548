"""The worker's half of ``draft_model`` speculation: drafts for the next step from this step's tapped states.

The target model taps the drafter's depths at its logits rows (``KimiModel.tap_layers`` -> ``tapped``
[R, taps, hidden]). After acceptance, each sampling chunk's last accepted row (a plain chunk: its one row; a
verification: row ``len(accepted)``, the position whose target token ended the chunk) and that token start the
drafter, which proposes ``num_speculative_tokens`` tokens; they travel back in ``SampledToken.draft_token_ids``
and the scheduler verifies them in the next step (trimmed to what max_tokens, max_model_len and free blocks
allow). Failed rows get no drafts; requests with penalties or grammars get them like any other (their rows are
processed ahead over the drafts, see ``spec_decode.acceptance``). A K3 DSpark checkpoint (``model_type``
``k3_dspark``) gets :class:`~rocm_k3.spec_decode.dspark_proposer.DSparkProposer` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from rocm_k3 import checkpoint_io
from rocm_k3.spec_decode.config import SpeculativeConfig
from rocm_k3.spec_decode.drafter import (CONFIG_FILE, TapDrafter, load_drafter, read_drafter_config,
                                         resolve_drafter_path)
from rocm_k3.spec_decode.dspark_config import MAX_DRAFTS, is_dspark_config
from rocm_k3.spec_decode.dspark_load import load_dspark
from rocm_k3.spec_decode.dspark_proposer import DSparkProposer
from rocm_k3.worker.step_io import SampledToken, ScheduledChunk


class DraftProposer:
    """Binds a drafter to the target ``model`` (sets its tapped depths) and proposes after each step."""

    def __init__(self, drafter: TapDrafter, model, num_speculative_tokens: int) -> None:
        self.drafter = drafter
        self.model = model
        self.k = num_speculative_tokens
        model.tap_layers = drafter.cfg.tap_layer_ids
        model.tap_outputs = False

    @classmethod
    def for_model(cls, config: SpeculativeConfig, model) -> DraftProposer | DSparkProposer:
        """The proposer of the drafter ``config.model`` names: a K3 DSpark checkpoint (``model_type``
        ``k3_dspark``) or rocm-k3's tap drafter."""
        cfg = model.cfg
        root = resolve_drafter_path(str(config.model), config.revision)
        if is_dspark_config(_config_json(root, f"draft model {str(config.model)!r}")):
            return _dspark_proposer(config, model, root)
        drafter = load_drafter(config.model, target_hidden_size=cfg.hidden_size,
                               target_num_hidden_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                               device=model.device, revision=config.revision)
        return cls(drafter, model, config.num_speculative_tokens)

    def drop(self, request_id: str) -> None:
        """Nothing is held per request."""

    def attach(self, chunks: Sequence[ScheduledChunk], sampled: Sequence[SampledToken]) -> tuple[SampledToken, ...]:
        """``sampled`` (one per sampling chunk of ``chunks``, the step's chunks) with the drafts of the next step
        attached (the tapped rows are in :func:`~rocm_k3.spec_decode.acceptance.expand_rows` order)."""
        rows, firsts, which = [], [], []
        row = 0
        for i, (c, tok) in enumerate(zip([c for c in chunks if c.sample], sampled)):
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


def _config_json(root: Path, where: str) -> object:
    """``root``'s config.json, or None when it is absent (the tap drafter's loader then names the problem);
    ValueError when it cannot be read (a pipe, a symlink out of the directory, not JSON)."""
    if not checkpoint_io.file_kind(root / CONFIG_FILE):
        return None
    return read_drafter_config(root, where)


def _dspark_proposer(config: SpeculativeConfig, model, root: Path) -> DSparkProposer:
    where = f"draft model {str(config.model)!r}"
    if config.num_speculative_tokens > MAX_DRAFTS:
        raise ValueError(f"{where}: num_speculative_tokens={config.num_speculative_tokens}, but a K3 DSpark drafter "
                         f"drafts at most {MAX_DRAFTS} tokens per block")
    if model.ctx.tp_size > 1:
        raise ValueError(f"{where}: a K3 DSpark drafter with tensor_parallel_size={model.ctx.tp_size} is not "
                         "supported: it runs on TP rank 0 with the target's LM head, which tensor parallelism "
                         "splits over the ranks; use tensor_parallel_size 1 or the tap drafter / method 'ngram'")
    cfg = model.cfg
    drafter = load_dspark(root, where, target_hidden_size=cfg.hidden_size,
                          target_num_hidden_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                          device=model.device, dtype=model.dtype)
    return DSparkProposer(drafter, model, config.num_speculative_tokens)
