"""The connector inside the engines (no server): a producer LLM publishes, a consumer LLM loads, with the features
users turn on beside it: chunked prefill on the producer, the consumer's own prefix cache (it fetches only the
pages past its cached prefix, and always the KDA state), and a load that fails (producer gone) recomputing. Runs
over both transports (NixlConnector skipped with its reason where nixl is not installed)."""

from __future__ import annotations

import random
import time

import pytest

from rocm_k3 import LLM, SamplingParams
from rocm_k3.kv_transfer.config import nixl_installed
from tests.pd_fixtures import free_port as _free_port
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


NO_NIXL = "nixl (the `nixl` extra: nixl-cu12) is not installed: NixlConnector cannot run here"


@pytest.fixture(scope="module", params=[
    pytest.param("SocketConnector", id="socket"),
    pytest.param("NixlConnector", id="nixl", marks=pytest.mark.skipif(not nixl_installed(), reason=NO_NIXL))])
def engines(request):
    port, name = _free_port(), request.param
    kw = dict(dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=259)
    # the socket engines move each layer as the forward takes it (the server tests cover the default: all layers
    # before the forward)
    extra = {"kv_connector_extra_config": {"layerwise": True}} if name == "SocketConnector" else {}
    plain = LLM(**kw)
    prod = LLM(kv_transfer_config={"kv_connector": name, "kv_role": "kv_producer", "kv_port": port, **extra}, **kw)
    cons = LLM(kv_transfer_config={"kv_connector": name, "kv_role": "kv_consumer", "timeout_s": 1.0, **extra},
               **kw)
    yield plain, prod, cons
    for llm in (plain, prod, cons):
        llm.shutdown()


def _run(llm: LLM, rid: str, ids: list[int], **kw):
    llm.engine.add_request(rid, ids, SamplingParams(**kw))
    return llm.engine.run_to_completion()[rid]


def _pd(prod: LLM, cons: LLM, rid: str, ids: list[int]):
    params = _run(prod, "p-" + rid, ids, temperature=0.0, max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True}).kv_transfer_params
    assert params["remote_num_tokens"] == len(ids) - 1
    return _run(cons, "d-" + rid, ids, **GREEDY, kv_transfer_params=params)


def test_chunked_producer_and_consumer_prefix_cache(engines):
    plain, prod, cons = engines
    rng = random.Random(0)
    prefix = [rng.randrange(1, 200) for _ in range(256)]
    ids = prefix + [rng.randrange(1, 200) for _ in range(44)]  # 300 tokens: producer chunks [0,256) [256,299) [299]
    expected = _run(plain, "r0", ids, **GREEDY).token_ids
    before = cons.engine.stats()
    got = _pd(prod, cons, "cold", ids)
    mid = cons.engine.stats()
    assert got.token_ids == expected
    assert mid["kv_transfer_loaded"] == before["kv_transfer_loaded"] + 1
    assert mid["prefill_tokens"] - before["prefill_tokens"] == 1  # only the last prompt token ran here
    full_bytes = mid["kv_transfer_bytes_received"] - before["kv_transfer_bytes_received"]
    # a loaded prompt leaves no KDA state at an aligned point here (only the one after N - 1): the consumer caches
    # a prefix it computed itself; a prompt sharing it then fetches only the pages past it (and the KDA state)
    _run(cons, "local", prefix + [7] * 10, **GREEDY)
    other = prefix + [rng.randrange(1, 200) for _ in range(44)]
    expected = _run(plain, "r1", other, **GREEDY).token_ids
    mid = cons.engine.stats()
    got = _pd(prod, cons, "warm", other)
    after = cons.engine.stats()
    assert got.token_ids == expected and got.num_cached_tokens == 256
    assert after["kv_transfer_loaded"] == mid["kv_transfer_loaded"] + 1
    warm_bytes = after["kv_transfer_bytes_received"] - mid["kv_transfer_bytes_received"]
    # the 256 cached tokens' pages stay on the producer: only the pages past them and the KDA state move
    conn = cons.engine.executor.worker.connector
    mla = sum(t[0].numel() * t.element_size() for group, t in conn._caches.values() if group == "mla")  # per block
    block_size = cons.engine.config.cache.block_size
    assert warm_bytes == full_bytes - 256 // block_size * mla > 0
    assert after["kv_transfer_failures"] == 0
    names = conn.layer_names()
    if conn.config.kv_connector_extra_config.get("layerwise"):  # fetched in the order the forward reads them
        assert names[0] == "kda.0.recurrent" and names.index("mla.0") > names.index("kda.1.conv")
    else:  # registration order: MLA pages first
        assert names[0] == "mla.0"


def test_failed_load_recomputes_the_prompt(engines):
    plain, _, cons = engines
    rng = random.Random(1)
    ids = [rng.randrange(1, 200) for _ in range(40)]
    expected = _run(plain, "f0", ids, **GREEDY).token_ids
    before = cons.engine.stats()
    gone = {"remote_transfer_id": "never-published", "remote_num_tokens": 39, "remote_host": "127.0.0.1",
            "remote_port": _free_port()}
    got = _run(cons, "f1", ids, **GREEDY, kv_transfer_params=gone)
    after = cons.engine.stats()
    assert got.token_ids == expected
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"] + 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == 1 + 40  # the failed step's token, then the prompt
    assert after["free_blocks"] == after["num_blocks"]


def test_malformed_kv_transfer_params_are_refused_before_queueing(engines):
    _, _, cons = engines
    with pytest.raises(ValueError, match="remote_num_tokens"):
        cons.engine.add_request("bad", [1, 2, 3], SamplingParams(kv_transfer_params={
            "remote_transfer_id": "x", "remote_num_tokens": "3", "remote_host": "h", "remote_port": 1}))
    assert not cons.engine.has_unfinished()


def test_concurrent_requests_publish_and_load_in_the_same_steps(engines):
    plain, prod, cons = engines
    rng = random.Random(2)
    prompts = {f"c{i}": [rng.randrange(1, 200) for _ in range(n)] for i, n in enumerate((17, 64, 130, 5))}
    for rid, ids in prompts.items():
        plain.engine.add_request(rid, ids, SamplingParams(**GREEDY))
        prod.engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=1,
                                                         kv_transfer_params={"do_remote_decode": True}))
    expected = plain.engine.run_to_completion()
    published = prod.engine.run_to_completion()
    before = cons.engine.stats()
    for rid, ids in prompts.items():  # queued together: their loads ride the same step
        params = published[rid].kv_transfer_params
        cons.engine.add_request(rid, ids, SamplingParams(**GREEDY, kv_transfer_params=params))
    got = cons.engine.run_to_completion()
    after = cons.engine.stats()
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in expected.items()}
    assert after["kv_transfer_loaded"] - before["kv_transfer_loaded"] == len(prompts)
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompts)


@pytest.mark.parametrize("where", ["execute", "update"])
def test_load_in_a_failed_step_is_recomputed_and_leaks_nothing(engines, where, monkeypatch):
    """A step carrying a load fails after the workers ran it (``execute``: the step is abandoned) or while its
    result is applied (``update``: the bookkeeping is rebuilt by recover()): the load is dropped, the prompt
    recomputed here, the tokens right, and no block, slot or producer entry is left behind."""
    plain, prod, cons = engines
    rng = random.Random(3)
    ids = [rng.randrange(1, 200) for _ in range(40)]
    expected = _run(plain, "x0", ids, **GREEDY).token_ids
    params = _run(prod, "p-x", ids, temperature=0.0, max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True}).kv_transfer_params
    core, fired = cons.engine, []
    if where == "execute":
        real = core.executor.execute

        def execute(step):
            out = real(step)
            if step.kv_connector_meta is not None and step.kv_connector_meta.loads and not fired:
                fired.append(step.step_id)
                raise RuntimeError("injected: the step failed after the load")
            return out
        monkeypatch.setattr(core.executor, "execute", execute)
    else:
        real = core.scheduler.update

        def update(output):
            if output.kv_received and not fired:
                fired.append(output.step_id)
                raise RuntimeError("injected: the update failed")
            return real(output)
        monkeypatch.setattr(core.scheduler, "update", update)
    before = core.stats()
    core.add_request("x1", ids, SamplingParams(**GREEDY, kv_transfer_params=params))
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(5):
            core.step()
    got = core.run_to_completion()["x1"]
    after = core.stats()
    assert fired and got.token_ids == expected
    assert after["kv_transfer_abandoned"] == before["kv_transfer_abandoned"] + 1
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == 40  # the whole prompt, here
    assert after["recoveries"] - before["recoveries"] == (where == "update")
    assert after["free_blocks"] == after["num_blocks"] and after["free_state_slots"] == after["num_state_slots"]
    store = prod.engine.executor.worker.connector.store
    deadline = time.monotonic() + 5  # the fetch released the producer's copy
    while store.num_entries() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.num_entries() == 0
