"""The decode step's faster host paths give what the plain ones gave: a layout written into a graph mirror equals
the one built on its own (decodes and verifications), and the per-step dataclasses built by ``dict_init`` stay
frozen, equal, hashable and picklable with their defaults."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from rocm_k3.worker.decode_layout import LAYOUT_ROWS, decode_layout
from rocm_k3.worker.model_runner import HostPlan
from rocm_k3.worker.step_io import SampledToken, ScheduledChunk


def _plan(lens: list[int], width: int, rng: np.random.Generator) -> HostPlan:
    n, total = len(lens), sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    starts = rng.integers(5, 40, n)
    positions = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, lens)]).astype(np.int64)
    saves = [(i, p) for i, k in enumerate(lens) for p in range(1, k)]
    return HostPlan(
        input_ids=rng.integers(0, 200, total), positions=positions, slot_mapping=rng.integers(0, 900, total),
        cu_seqlens=cu, seq_lens=(starts + np.array(lens)).astype(np.int32),
        block_table=rng.integers(0, 50, (n, width)).astype(np.int32), kda_slots=rng.integers(0, 9, n).astype(np.int32),
        has_initial_state=np.ones(n, dtype=bool), logits_indices=(cu[1:] - 1).astype(np.int64),
        save_positions=np.array(saves, dtype=np.int32).reshape(-1, 2) if saves else None,
        save_slots=np.arange(len(saves), dtype=np.int32) + 20 if saves else None, is_decode=max(lens) == 1)


@pytest.mark.parametrize("lens, w", [([1, 1, 1], 1), ([1, 3, 2], 3)])
def test_layout_into_a_mirror_equals_the_layout_alone(lens: list[int], w: int) -> None:
    rng = np.random.default_rng(0)
    plan = _plan(lens, 4, rng)
    groups, rows = 4, 4 * w
    kw = dict(pad_block=77, block_size=16, pad_slot=99)
    alone = decode_layout(plan, groups, w, **kw)
    poison = {name: np.full(rows + 3, -5, dtype=getattr(alone, name).dtype) for name in LAYOUT_ROWS}
    poison["block_table"] = np.full((rows + 3, 6), -5, dtype=np.int32)  # wider than the plan's table
    into = decode_layout(plan, groups, w, **kw, out=poison)
    for name in (*LAYOUT_ROWS, "block_table"):
        np.testing.assert_array_equal(getattr(into, name), getattr(alone, name))
        assert np.shares_memory(getattr(into, name), poison[name])
        np.testing.assert_array_equal(poison[name][:rows, :4] if name == "block_table" else poison[name][:rows],
                                      getattr(alone, name))
    assert (poison["block_table"][:, 4:] == -5).all() and all((poison[n][rows:] == -5).all() for n in LAYOUT_ROWS)
    np.testing.assert_array_equal(into.rows, alone.rows)


def test_dict_init_dataclasses_keep_frozen_equal_hashable_picklable() -> None:
    c = ScheduledChunk(request_id="a", token_ids=(1,), start=5, admitted=False, block_ids=(), kda_slot=3,
                       is_prefill=False, sample=True)
    assert (c.saves, c.images, c.num_draft, c.slot_moved, c.prompt_logprob_rows) == ((), (), 0, False, 0)
    back = pickle.loads(pickle.dumps(c))
    assert back == c and hash(back) == hash(c) and dataclasses.replace(c, start=6).start == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.start = 6  # type: ignore[misc]
    with pytest.raises(TypeError):
        ScheduledChunk("a")  # type: ignore[call-arg]
    t = SampledToken("r", 7)
    assert (t.logprobs, t.error, t.accepted, t.draft_token_ids) == (None, "", (), ()) and t == SampledToken("r", 7)
