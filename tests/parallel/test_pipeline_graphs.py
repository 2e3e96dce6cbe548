"""dist tier: per-stage decode graphs under pipeline parallelism (issue #32), as real processes over gloo on the CPU.

Each stage's graph holds only its layers; a later stage's graph reads the previous stage's state from fixed input
buffers that the receive fills, and a stage's output goes on by a send of a copy, both outside the graph
(:mod:`rocm_k3.worker.cuda_graph`). The CPU cannot capture graphs, so the ranks here run with
:class:`tests.eager_graphs.EagerGraphs`: the same buffers, bucket padding, fixed-buffer receives, sends and shape
agreement, each replay an eager forward over those buffers. Checked: PP2 (two micro-batches in flight) and
TP2 x PP2 on the trained embedded model give one process's greedy tokens, every rank replayed 'graphs'.
The TP2 x PP2 run is marked slow (PP2 is its fast twin); the captured graphs run in the cuda tier
(tests/worker/test_stage_graphs.py).
"""

from __future__ import annotations

import pytest

from rocm_k3.engine.llm import LLM
from rocm_k3.executor import multiproc
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.sampling_params import SamplingParams
from tests.eager_graphs import EagerGraphs
from tests.parallel.test_dist import ENGINE, free_port

pytestmark = pytest.mark.dist
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# five requests, four running at once: a micro-batch holds two, so decode steps of one and two rows replay
# buckets 1 and 2 (and the ramp pads one row into bucket 2)
PROMPTS = ["The file", "Return the number of", "If the value is", "def main", "# compute"]
_RANK_MAIN = multiproc._rank_main


def _rank_with_stage_graphs(*args, **kwargs) -> None:
    """A rank (``multiproc._rank_main``) whose worker builds decode graphs on the CPU with the eager stand-in."""
    from rocm_k3.worker import worker as worker_module

    worker_module.DecodeGraphs = EagerGraphs
    worker_module.Worker._graphs_wanted = lambda self: True
    worker_module.Worker._graph_safe = lambda self: (True, "the CPU stand-in")
    _RANK_MAIN(*args, **kwargs)


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    llm = LLM(EMBEDDED_DIR, **ENGINE)  # one process: eager
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def _graphed(monkeypatch, **layout) -> tuple[list[list[int]], dict, list[dict]]:
    monkeypatch.setattr(multiproc, "_rank_main", _rank_with_stage_graphs)
    llm = LLM(EMBEDDED_DIR, master_port=free_port(), **ENGINE, **layout)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        stats, ranks = llm.stats(), llm.engine.executor.rank_stats()
    finally:
        llm.shutdown()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["free_state_slots"] == stats["num_state_slots"]
    return [o.token_ids for o in outs], stats, ranks


def test_pp2_stage_graphs_pipelined_give_one_process_tokens(single, monkeypatch) -> None:
    tokens, stats, ranks = _graphed(monkeypatch, pipeline_parallel_size=2)
    assert tokens == single
    assert stats["steps_in_flight_max"] == 2, stats
    assert len(ranks) == 2 and all(r["graph_replays"] > 0 for r in ranks), ranks
    # both stages replayed the same steps: each decode step's state crossed through the fixed buffers
    assert ranks[0]["graph_replays"] == ranks[1]["graph_replays"]


@pytest.mark.slow
def test_tp2_pp2_stage_graphs_give_one_process_tokens(single, monkeypatch) -> None:
    tokens, stats, ranks = _graphed(monkeypatch, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert tokens == single
    assert stats["steps_in_flight_max"] == 2, stats
    assert len(ranks) == 4 and len({r["graph_replays"] for r in ranks}) == 1 and ranks[0]["graph_replays"] > 0
