"""The TP-1 wire layout of KDA state: shards merged by a TP-2 producer equal a TP-1 model's state, and a TP-2
consumer's cut of it equals each rank's own shard (q | k | v heads of the conv state kept apart)."""

from __future__ import annotations

import pytest
import torch

from rocm_k3.kv_transfer.tp_layout import TPShard, merge_heads, split_heads

H, D, W = 4, 3, 4


def _full():
    rec = torch.arange(H * D * D, dtype=torch.float32).reshape(H, D, D)  # [H, K, V]
    conv = torch.arange(3 * H * D * (W - 1), dtype=torch.float32).reshape(3 * H * D, W - 1)  # [3 H K, W-1]
    return rec, conv


def _shard(conv: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """What a TP rank's conv pool holds: its heads' rows of q, then of k, then of v (the model's layout)."""
    hl = H // tp
    return torch.cat([conv[i * H * D + rank * hl * D : i * H * D + (rank + 1) * hl * D] for i in range(3)])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merge_and_split_are_inverse_and_match_the_model_layout(tp):
    rec, conv = _full()
    rec_shards = [rec[r * H // tp : (r + 1) * H // tp] for r in range(tp)]
    conv_shards = [_shard(conv, r, tp) for r in range(tp)]
    assert torch.equal(merge_heads("kda.0.recurrent", rec_shards), rec)
    assert torch.equal(merge_heads("kda.0.conv", conv_shards), conv)
    for r in range(tp):
        assert torch.equal(split_heads("kda.0.recurrent", rec, r, tp), rec_shards[r])
        assert torch.equal(split_heads("kda.0.conv", conv, r, tp), conv_shards[r])


def test_split_names_heads_that_do_not_divide_and_unknown_names():
    rec, conv = _full()
    with pytest.raises(ValueError, match="does not split over 3"):
        split_heads("kda.0.recurrent", rec, 0, 3)
    with pytest.raises(ValueError, match="not a KDA state name"):
        split_heads("mla.0", rec, 0, 2)
    with pytest.raises(ValueError, match="needs a process group"):
        TPShard(0, 2)
    with pytest.raises(ValueError, match="out of range"):
        TPShard(2, 2, group=object())


def _tp2_rank(rank: int, port: int, store_port: int, results) -> None:
    """A TP-2 producer and a TP-2 consumer on two gloo ranks: the producer's shards are published once, in the
    TP-1 layout; each consumer rank gets its own heads back, rank 1's failure fails the load on both ranks, and
    rank 0 releases the producer's copies."""
    import os

    import torch.distributed as dist

    from rocm_k3.kv_transfer.base import ConnectorMeta, ReqTransfer
    from rocm_k3.kv_transfer.config import KVTransferConfig
    from rocm_k3.kv_transfer.socket_connector import SocketConnectorWorker
    from rocm_k3.kv_transfer.socket_transport import TransferError
    from rocm_k3.kv_transfer.tp_layout import TPShard, gather_heads

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tp = TPShard(rank, 2, dist.new_group([0, 1], backend="gloo"))
        rec, conv = _full()
        mla = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(2, 4, 5)  # [blocks, block_size, latent]
        names = ("mla.0", "kda.0.recurrent", "kda.0.conv")

        def pools(fill: bool) -> tuple[dict, dict]:
            pick = (lambda t: t) if fill else torch.zeros_like
            return ({"mla.0": pick(mla if rank == 0 else torch.zeros_like(mla)).clone()},  # rank 1's MLA unused
                    {"kda.0.recurrent": pick(split_heads("kda.0.recurrent", rec, rank, 2)).unsqueeze(0).clone(),
                     "kda.0.conv": pick(split_heads("kda.0.conv", conv, rank, 2)).unsqueeze(0).clone()})

        prod = SocketConnectorWorker(KVTransferConfig("SocketConnector", "kv_producer", kv_port=store_port), tp)
        prod.register_kv_caches(*pools(True))
        meta = ConnectorMeta(saves=(ReqTransfer("r", "r", (0, 1), 0, 7),))
        for name in names:
            prod.save_kv_layer(name, meta)
        out = {"store": prod.store is not None, "gather_none": gather_heads("kda.0.recurrent", rec[:2], tp) is None}
        cons = SocketConnectorWorker(KVTransferConfig("SocketConnector", "kv_consumer", kv_port=store_port,
                                                      timeout_s=2.0), tp)
        mla_pool, kda_pools = pools(False)
        cons.register_kv_caches(mla_pool, kda_pools)
        loads = ConnectorMeta(loads=(ReqTransfer("d", "r", (0, 1), 0, 7),))
        cons.start_load_kv(loads)
        for name in names:
            cons.wait_for_layer_load(name)
        out["mla"] = torch.equal(mla_pool["mla.0"], mla)
        out["rec"] = torch.equal(kda_pools["kda.0.recurrent"][0], split_heads("kda.0.recurrent", rec, rank, 2))
        out["conv"] = torch.equal(kda_pools["kda.0.conv"][0], split_heads("kda.0.conv", conv, rank, 2))
        first = cons.get_finished()
        out["first"] = (sorted(first.received), sorted(first.failed))
        out["left"] = prod.store.num_entries() if prod.store is not None else None
        for name in names:  # published again, loaded again: fine on rank 0, failed on rank 1 only
            prod.save_kv_layer(name, meta)
        cons.start_load_kv(loads)
        for name in names:
            cons.wait_for_layer_load(name)
        out["rank0_ok"] = not cons._failed
        if rank == 1:
            cons._fail("d", TransferError("checksum mismatch (injected)"))
        second = cons.get_finished()
        out["second"] = (sorted(second.received), sorted(second.failed))
        prod.close()
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_tp2_producer_and_consumer_over_gloo_ranks():
    import socket

    import torch.multiprocessing as mp

    from tests.pd_fixtures import free_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_tp2_rank, args=(port, free_port(), results), nprocs=2, join=True)
        results = dict(results)
    assert results[0]["store"] and not results[1]["store"]  # rank 0 alone publishes
    assert results[1]["gather_none"] and not results[0]["gather_none"]
    for rank in (0, 1):
        out = results[rank]
        assert out["mla"] and out["rec"] and out["conv"], (rank, out)
        assert out["first"] == (["d"], [])
        assert out["rank0_ok"], rank  # the second load itself went through ...
        assert out["second"] == ([], ["d"])  # ... but rank 1's failure is every rank's
    assert results[0]["left"] == 0  # rank 0 released the producer's copies once both ranks had them
