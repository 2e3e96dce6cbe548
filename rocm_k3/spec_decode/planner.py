"""The scheduler's half of speculative decoding (integers only): drafts, per-position state slots, settling.

Design: **one state slot per draft position** (vLLM's layout), reusing the prefill save path. A verification
chunk runs the sequence's last token plus d drafts through the prefill path in one forward; its ``saves`` ask for
the KDA recurrent + conv state after the last token and after each of the first d - 1 drafts (d slots; slot j
holds the state after accepting j drafts); the running slot ends holding the state after all d drafts. After
acceptance of a drafts, slot a (or the running slot when a == d) holds exactly the state after the last accepted
token: it *becomes* the running slot (no copy), the others go back to the pool. MLA rows written for rejected
drafts lie past the sequence's length and are overwritten by the next step; decode blocks are never published to
the prefix cache, and the slots are never published either. Chosen over checkpoint + replay because it needs no
second forward and no tensor copy, and on the reference backend every position can be saved; the price is d
extra slots per speculating sequence, held for the duration of one step only (fewer free slots: fewer drafts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rocm_k3.cache.manager import CacheManager
from rocm_k3.spec_decode.config import SpeculativeConfig
from rocm_k3.spec_decode.ngram import propose_ngram

# the engine's Sequence / ScheduledSeq (engine imports this module, never the reverse)
Sequence = Any
ScheduledSeq = Any


@dataclasses.dataclass
class SpecStats:
    """Cumulative counters (vLLM's spec-decode metrics): verification steps, drafted and accepted tokens, and
    accepted drafts per position (``accepted_per_pos[j]``: how often draft j + 1 was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {
            "spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            # tokens per verification step: the accepted drafts plus the target's own token
            "spec_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
        }
        for j, n in enumerate(self.accepted_per_pos):
            out[f"spec_num_accepted_tokens_pos{j}"] = n
            out[f"spec_acceptance_rate_pos{j}"] = n / self.num_drafts if self.num_drafts else 0.0
        return out


class SpecPlanner:
    """Drafts for decoding sequences and the slot plan of their verification (a no-op without a config)."""

    def __init__(self, config: SpeculativeConfig | None, cache: CacheManager, max_model_len: int) -> None:
        self.config = config
        self.cache = cache
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * (config.num_speculative_tokens if config else 0))
        self._moved: set[int] = set()  # sequences whose running slot changed since their last chunk was sent

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Drafts for a decoding ``seq`` whose next position is covered: at most ``budget`` tokens, never past
        max_tokens or max_model_len, with blocks for them only while free. Requests with penalties or grammars
        speculate too (the worker processes each verification row as after the drafts before it)."""
        cfg = self.config
        if cfg is None or budget <= 0:
            return []
        room = min(cfg.num_speculative_tokens, budget, seq.max_tokens - len(seq.output_token_ids) - 1,
                   self.max_model_len - seq.num_computed_tokens - 1)
        if room <= 0:
            return []
        if cfg.method == "draft_model":  # the worker's drafter proposed them after the step that made the last token
            at, proposed = seq.proposal
            drafts = list(proposed[:room]) if at == seq.num_tokens else []
        else:
            drafts = propose_ngram(seq.token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if drafts and not self.cache.ensure_capacity(seq.seq_id, seq.num_computed_tokens + 1 + len(drafts)):
            return []
        return drafts

    def plan_slots(self, item: ScheduledSeq) -> None:
        """Per-position state slots for a verification chunk (``item.saves``); drafts without a slot are cut."""
        slots = self.cache.allocate_spec_slots(len(item.drafts))
        if len(slots) < len(item.drafts):
            item.drafts = item.drafts[: len(slots)]
            item.num_new_tokens = 1 + len(item.drafts)
        item.saves = [(item.start + 1 + j, slot) for j, slot in enumerate(slots)]

    def settle(self, item: ScheduledSeq, accepted: int) -> None:
        """After the verification ran: the state after ``accepted`` drafts becomes the running state."""
        d = len(item.drafts)
        if not 0 <= accepted <= d:
            raise RuntimeError(f"request {item.seq.request_id!r}: {accepted} accepted of {d} drafts")
        slots = [slot for _, slot in item.saves]
        keep = slots[accepted] if accepted < len(slots) else None
        self.cache.settle_spec_slots(item.seq.seq_id, slots, keep)
        item.saves = []
        if keep is not None:
            self._moved.add(item.seq.seq_id)
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += d
        st.num_accepted_tokens += accepted
        for j in range(accepted):
            st.accepted_per_pos[j] += 1

    def forget(self, seq_id: int) -> None:
        """The sequence left the running set (finished or preempted; a re-admission sends its slot anew)."""
        self._moved.discard(seq_id)

    def num_tracked(self) -> int:
        """Sequences this planner still holds bookkeeping for (a moved running slot not yet sent): 0 once every
        request has finished (a leak check)."""
        return len(self._moved)

    def take_moved(self, seq_id: int) -> bool:
        """Whether ``seq_id``'s running slot moved since its last chunk (then the worker takes the new slot)."""
        if seq_id in self._moved:
            self._moved.discard(seq_id)
            return True
        return False
