"""kv_transfer: the connector interface, the loopback TCP transport and its checksums (unit level, no engine)."""

from __future__ import annotations

import time

import pytest
import torch

from rocm_k3.kv_transfer import checksum
from rocm_k3.kv_transfer.base import ConnectorMeta, ReqTransfer
from rocm_k3.kv_transfer.config import KVTransferConfig, nixl_installed
from rocm_k3.kv_transfer.socket_connector import SocketConnectorScheduler, SocketConnectorWorker
from rocm_k3.kv_transfer.socket_transport import BlockStore, entry_key
from rocm_k3.kv_transfer.workers import connector_worker

NO_NIXL = "nixl (the `nixl` extra: nixl-cu12) is not installed: NixlConnector cannot run here"
CONNECTORS = [pytest.param("SocketConnector", id="socket"),
              pytest.param("NixlConnector", id="nixl", marks=pytest.mark.skipif(not nixl_installed(), reason=NO_NIXL))]

MLA_LAYERS = ("layers.1.mla", "layers.3.mla")
KDA_LAYERS = ("layers.0.kda.recurrent", "layers.0.kda.conv", "layers.2.kda.recurrent", "layers.2.kda.conv")


def _caches(fill: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    make = (lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)) if fill else \
        (lambda *s: torch.zeros(*s, dtype=torch.bfloat16))
    mla = {n: make(8, 4, 16) for n in MLA_LAYERS}  # [num_blocks, block_size, kv_lora + rope]
    kda = {n: (make(4, 2, 8, 8) if "recurrent" in n else make(4, 2, 8, 3)) for n in KDA_LAYERS}  # [slots, H, ...]
    return mla, kda


@pytest.fixture(params=CONNECTORS)
def connector(request) -> str:
    return request.param


def _pair(connector: str, timeout_s: float = 2.0) -> tuple[SocketConnectorWorker, SocketConnectorWorker]:
    prod = connector_worker(KVTransferConfig(connector, "kv_producer", kv_port=0))
    port = prod.store.address[1]
    cons = connector_worker(KVTransferConfig(connector, "kv_consumer", kv_port=port, timeout_s=timeout_s))
    prod.register_kv_caches(*_caches(True))
    cons.register_kv_caches(*_caches(False))
    return prod, cons


SRC = ReqTransfer("p-req", "p-req", (1, 5, 2), 3, 11)
DST = ReqTransfer("d-req", "p-req", (0, 6, 7), 1, 11)


def _publish(prod: SocketConnectorWorker) -> None:
    meta = ConnectorMeta(saves=(SRC,))
    for name in (*MLA_LAYERS, *KDA_LAYERS):
        prod.save_kv_layer(name, meta)
    prod.wait_for_save()


def _load(cons: SocketConnectorWorker) -> None:
    cons.start_load_kv(ConnectorMeta(loads=(DST,)))
    for name in (*MLA_LAYERS, *KDA_LAYERS):
        cons.wait_for_layer_load(name)


def test_checksum_uses_xxhash_when_installed():
    pytest.importorskip("xxhash")
    assert checksum.ALGORITHM == "xxh3_64"
    assert checksum.verify(b"abc", checksum.digest(b"abc"))
    assert not checksum.verify(b"abd", checksum.digest(b"abc"))


def test_round_trip_moves_mla_blocks_and_kda_state_and_frees_producer(connector):
    prod, cons = _pair(connector)
    try:
        _publish(prod)
        assert prod.store.num_entries() == len(MLA_LAYERS) + len(KDA_LAYERS)
        _load(cons)
        fin = cons.get_finished()
        assert fin.received == {"d-req"} and not fin.failed
        for name in MLA_LAYERS:
            assert torch.equal(cons._caches[name][1][[0, 6, 7]], prod._caches[name][1][[1, 5, 2]])
            assert cons._caches[name][1][1].abs().sum() == 0  # untouched blocks stay untouched
        for name in KDA_LAYERS:
            assert torch.equal(cons._caches[name][1][1], prod._caches[name][1][3])
        assert cons.stats.blocks_received == 3 * len(MLA_LAYERS) + len(KDA_LAYERS)
        assert cons.stats.bytes_received == prod.stats.bytes_sent > 0
        deadline = time.monotonic() + 5
        while prod.store.num_entries() and time.monotonic() < deadline:  # the consumer's release is async
            time.sleep(0.01)
        assert prod.store.num_entries() == 0
    finally:
        prod.close()


def test_corrupted_block_is_detected_and_not_used(connector):
    prod, cons = _pair(connector)
    try:
        _publish(prod)
        entry = prod.store.entry(entry_key("p-req", KDA_LAYERS[2]))
        entry.data[5] ^= 0x40  # injected corruption in place: the stored checksum is of the original bytes
        _load(cons)
        fin = cons.get_finished()
        assert fin.failed == {"d-req"} and not fin.received
        assert cons.stats.checksum_failures == 1 and cons.stats.failed_transfers == 1
        assert cons._caches[KDA_LAYERS[2]][1].abs().sum() == 0
    finally:
        prod.close()


def test_missing_transfer_times_out_and_fails_the_request(connector):
    prod, cons = _pair(connector, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        _load(cons)  # nothing was published
        assert time.monotonic() - t0 < 10
        fin = cons.get_finished()
        assert fin.failed == {"d-req"}
        assert cons.stats.timeouts == 1
    finally:
        prod.close()


def test_dead_producer_fails_the_request(connector):
    prod, cons = _pair(connector, timeout_s=0.5)
    prod.close()
    _load(cons)
    assert cons.get_finished().failed == {"d-req"}


def test_store_entries_expire_after_ttl():
    store = BlockStore(ttl_s=0.05)
    try:
        store.put("t/x", torch.arange(3, dtype=torch.uint8))
        time.sleep(0.1)
        assert store.num_entries() == 0
    finally:
        store.close()


def test_scheduler_halves_hand_the_transfer_over():
    prod = SocketConnectorScheduler(KVTransferConfig("SocketConnector", "kv_producer", kv_port=15000))
    delay, params = prod.request_finished("p-req", (1, 5, 2), 3, 11)
    assert not delay  # the store holds a copy: the producer's blocks are freed at once
    assert params == {"remote_transfer_id": "p-req", "remote_num_tokens": 11, "remote_host": "127.0.0.1",
                      "remote_port": 15000}
    cons = SocketConnectorScheduler(KVTransferConfig("SocketConnector", "kv_consumer"), block_size=4)
    assert cons.get_num_new_matched_tokens("d-req", 12, 0, None) == (0, False)
    assert cons.get_num_new_matched_tokens("d-req", 12, 4, {"do_remote_decode": True}) == (0, False)
    assert cons.get_num_new_matched_tokens("d-req", 12, 4, params) == (7, False)  # 11 remote, 4 cached here
    cons.update_state_after_alloc("d-req", (0, 6, 7, 9), 1, 7)
    meta = cons.build_connector_meta()
    # blocks of tokens [4, 11) only: the first (cached) block stays; the producer's list is read from block 1
    assert meta.loads == (ReqTransfer("d-req", "p-req", (6, 7), 1, 11, first_block=1, remote_host="127.0.0.1",
                                      remote_port=15000),) and not meta.saves
    assert cons.build_connector_meta() == ConnectorMeta()
    assert cons.get_num_new_matched_tokens("e", 11, 0, params) == (10, False)  # the last prompt token is computed
    for bad, key in (({"remote_transfer_id": "x", "remote_num_tokens": -1}, "remote_num_tokens"),
                     ({**params, "remote_transfer_id": 3}, "remote_transfer_id"),
                     ({**params, "remote_port": "80"}, "remote_port")):
        with pytest.raises(ValueError, match=key):
            cons.get_num_new_matched_tokens("x", 12, 0, bad)


@pytest.mark.parametrize("text,match", [
    ("{", "not valid JSON"),
    ('{"kv_role": "kv_producer"}', "kv_connector"),
    ('{"kv_connector": "LMCacheConnector", "kv_role": "kv_producer"}', "kv_connector must be one of"),
    ('{"kv_connector": "SocketConnector", "kv_role": "producer"}', "kv_role must be one of"),
    ('{"kv_connector": "SocketConnector", "kv_role": "kv_both", "bogus": 1}', "unknown keys"),
])
def test_kv_transfer_config_rejects_bad_input(text, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.from_json(text)


def test_nixl_connector_without_nixl_is_refused_at_the_boundary(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("nixl", "nixl_cu12") else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'rocm-k3\[nixl\]'"):
        KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}')


def test_kv_transfer_config_parses_vllm_keys():
    cfg = KVTransferConfig.from_json('{"kv_connector": "SocketConnector", "kv_role": "kv_both", "kv_port": 0}')
    assert cfg.is_producer and cfg.is_consumer
