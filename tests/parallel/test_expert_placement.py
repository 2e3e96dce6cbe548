"""Expert placement (EPLB-style): replicas go to the busiest experts, replicas of one expert to distinct ranks,
ranks balanced by load; files round-trip; bad placements and loads are named. The command writes one."""

from __future__ import annotations

import json

import pytest

from rocm_k3.cli import main
from rocm_k3.distributed.context import LayoutError, ParallelConfig
from rocm_k3.model.expert_placement import ExpertPlacement, balanced_slots


def test_uniform_placement_is_the_identity_without_redundant_experts() -> None:
    assert ExpertPlacement.uniform(8, 0, 2).slots(3) == tuple(range(8))
    spread = ExpertPlacement.uniform(8, 2, 2).slots(3)  # equal loads: experts 0 and 1 get the replicas
    assert sorted(spread) == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7] and 0 in spread[:5] and 0 in spread[5:]


def test_replicas_go_to_the_busiest_experts_on_distinct_ranks() -> None:
    loads = [100, 1, 1, 1, 60, 1, 1, 1]
    slots = balanced_slots(loads, 2, 2)  # 10 slots, 5 per rank
    assert len(slots) == 10 and sorted(set(slots)) == list(range(8))
    assert slots.count(0) == 2 and slots.count(4) == 2  # the two busiest get the replicas
    ranks = [slots[:5], slots[5:]]
    assert all(len(set(r)) == 5 for r in ranks)  # no expert twice on one rank
    share = {e: loads[e] / slots.count(e) for e in range(8)}
    totals = [sum(share[e] for e in r) for r in ranks]
    assert abs(totals[0] - totals[1]) <= max(share.values())  # balanced within one replica's load
    one_rank_all = sum(loads[e] for e in range(4))
    assert max(totals) < one_rank_all  # better than the contiguous split (experts 0-3 on rank 0)


def test_placement_file_round_trip_and_errors(tmp_path) -> None:
    p = ExpertPlacement.from_loads({3: [5, 1, 1, 1], 5: [1, 1, 1, 9]}, 2, 2)
    path = tmp_path / "placement.json"
    path.write_text(p.to_json())
    assert ExpertPlacement.read(path) == p
    with pytest.raises(LayoutError, match="every expert"):
        ExpertPlacement(4, 2, 2, {1: (0, 0, 1, 1, 2, 2)})
    with pytest.raises(LayoutError, match="rank 0 holds an expert twice"):
        ExpertPlacement(4, 2, 2, {1: (0, 0, 1, 2, 3, 1)})
    with pytest.raises(LayoutError, match="does not split"):
        balanced_slots([1] * 8, 1, 2)
    with pytest.raises(LayoutError, match="at most 2"):
        balanced_slots([100, 1], 4, 2)
    path.write_text("{not json")
    with pytest.raises(LayoutError, match="cannot read"):
        ExpertPlacement.read(path)
    with pytest.raises(LayoutError, match="enable_expert_parallel"):
        ParallelConfig(tensor_parallel_size=2, num_redundant_experts=2)
    with pytest.raises(LayoutError, match="tensor_parallel_size must be > 1"):
        ParallelConfig(enable_expert_parallel=True, num_redundant_experts=2)
    with pytest.raises(LayoutError, match="ep_decode_dispatch: expected one of"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True, ep_decode_dispatch="padded")


def test_command_writes_a_placement_from_recorded_loads(tmp_path, capsys) -> None:
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"layers": {"1": [9, 1, 1, 1, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 9]}}))
    out = tmp_path / "placement.json"
    assert main(["expert-placement", str(loads), "--ep-size", "2", "--num-redundant-experts", "2",
                 "-o", str(out)]) == 0
    p = ExpertPlacement.read(out)
    assert p.slots(1).count(0) == 2 and p.slots(2).count(7) == 2
    assert "2 layers" in capsys.readouterr().out
    loads.write_text(json.dumps({"layers": {}}))
    assert main(["expert-placement", str(loads), "--ep-size", "2", "-o", str(out)]) == 2
    assert "no layers recorded" in capsys.readouterr().err
