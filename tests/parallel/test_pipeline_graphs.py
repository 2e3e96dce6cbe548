"""dist tier: per-stage decode graphs under pipeline parallelism (issue #32), as real processes over gloo on the CPU.

Each stage's graph holds only its layers; a later stage's graph reads the previous stage's state from fixed input
buffers that the receive fills, and a stage's output goes on by a send of a copy, both outside the graph
(:mod:`rocm_k3.worker.cuda_graph`). The CPU cannot capture graphs, so the ranks here run with
:class:`tests.eager_graphs.EagerGraphs`: the same buffers, bucket padding, fixed-buffer receives, sends and shape
agreement, each replay an eager forward over those buffers. Checked: PP2 (two micro-batches in flight) and
TP2 x PP2, both with n-gram speculation (k = 2), on the trained embedded model give one process's greedy tokens
(eager, without speculation), and every rank replayed the same decode and verification (1 + k rows a sequence)
'graphs'.
The TP2 x PP2 run is marked slow (the PP2 run is its fast twin); the captured graphs run in the cuda tier
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
PROMPTS = ["The file", "hello hello hello hello hello hello", "If the value is", "1 2 3 4 5 6 7 8 9 10 11 12",
           "# compute"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
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


def test_pp2_stage_graphs_pipelined_with_ngram_give_one_process_tokens(single, monkeypatch) -> None:
    tokens, stats, ranks = _graphed(monkeypatch, pipeline_parallel_size=2, speculative_config=NGRAM)
    assert tokens == single
    assert stats["steps_in_flight_max"] == 2 and stats["spec_num_accepted_tokens"] > 0, stats
    # both stages replayed the same decode and verification graphs: each such step's state crossed through the
    # fixed input buffers
    replays = [(r["graph_replays"], r["graph_verify_replays"]) for r in ranks]
    assert len(ranks) == 2 and replays[0] == replays[1], ranks
    assert replays[0][1] > 0 and replays[0][0] > replays[0][1], ranks  # verifications and plain decodes


@pytest.mark.slow
def test_tp2_pp2_stage_graphs_give_one_process_tokens(single, monkeypatch) -> None:
    tokens, stats, ranks = _graphed(monkeypatch, pipeline_parallel_size=2, tensor_parallel_size=2,
                                    speculative_config=NGRAM)
    assert tokens == single
    assert stats["steps_in_flight_max"] == 2 and stats["spec_num_accepted_tokens"] > 0, stats
    assert len(ranks) == 4 and ranks[0]["graph_replays"] > 0 and ranks[0]["graph_verify_replays"] > 0, ranks
    assert len({(r["graph_replays"], r["graph_verify_replays"]) for r in ranks}) == 1, ranks
