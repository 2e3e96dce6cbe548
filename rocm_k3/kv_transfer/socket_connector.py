"""``SocketConnector``: the KV connector over the loopback TCP transport (``socket_transport``).

The producer publishes each layer's slice of a request's MLA pages (``GROUP_MLA``) or KDA state slot
(``GROUP_KDA``) into its ``BlockStore`` as it is computed; the consumer fetches every layer on a background thread
(so layer i+1 is on the wire while layer i is copied in), verifies each checksum, and copies into its own blocks.
Any failure (mismatch, timeout, producer gone) marks the request failed: the engine recomputes its prompt.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from rocm_k3.kv_transfer.base import (GROUP_KDA, GROUP_MLA, ConnectorMeta, FinishedTransfers, KVConnectorWorker,
                                      ReqTransfer)
from rocm_k3.kv_transfer.config import KVTransferConfig
from rocm_k3.kv_transfer.socket_scheduler import SocketConnectorScheduler  # noqa: F401 (the connector's two halves)
from rocm_k3.kv_transfer.socket_transport import BlockClient, BlockStore, TransferError, entry_key
from rocm_k3.kv_transfer.tp_layout import TPShard, agree_failed, gather_heads, split_heads


@dataclasses.dataclass
class KVTransferStats:
    """Counters exported on /metrics (monotonic)."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    failed_transfers: int = 0
    checksum_failures: int = 0
    timeouts: int = 0


def tensor_from_bytes(payload: bytes, meta: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, meta["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {meta['dtype']!r} in transfer")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(meta["shape"])


@dataclasses.dataclass
class LoadBatch:
    """One step's loads and what its fetch thread has fetched so far (a thread left over from an interrupted step
    fills its own batch, never the next step's). ready: per layer, set once every load's entry of it is fetched;
    waited: layers copied in so far."""

    loads: tuple[ReqTransfer, ...]
    ready: dict[str, threading.Event]
    fetched: dict[tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    waited: set[str] = dataclasses.field(default_factory=set)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class SocketConnectorWorker(KVConnectorWorker):
    """Worker half; a producer's TP rank 0 owns a ``BlockStore`` on (kv_ip, kv_port), a consumer's ranks each a
    ``BlockClient`` to the producer's. Payloads are in the TP-1 layout (``tp_layout``), whatever either side's TP."""

    def __init__(self, config: KVTransferConfig, tp: TPShard | None = None) -> None:
        self.config = config
        self.tp = tp or TPShard()
        self.stats = KVTransferStats()
        self._caches: dict[str, tuple[str, torch.Tensor]] = {}
        ttl_s = float(config.kv_connector_extra_config.get("ttl_s", 60.0))
        publishes = config.is_producer and self.tp.is_first
        self.store = self._new_store(config.kv_ip, config.kv_port, ttl_s) if publishes else None
        self._batch = LoadBatch((), {})
        self._failed: set[str] = set()
        self._received: set[str] = set()
        self._sent: set[str] = set()

    def _new_store(self, host: str, port: int, ttl_s: float) -> BlockStore:
        """The producer's store (a transport subclass serves it its own way)."""
        return BlockStore(host, port, ttl_s=ttl_s)

    def _new_client(self, host: str, port: int) -> BlockClient:
        """A consumer's client of the producer at ``host:port``, for one step's loads."""
        return BlockClient(host, port, self.config.timeout_s)

    def register_kv_caches(self, kv_caches: dict[str, Any], kda_states: dict[str, Any] | None = None) -> None:
        for name, t in kv_caches.items():
            self._caches[name] = (GROUP_MLA, t)
        for name, t in (kda_states or {}).items():
            if name in self._caches:
                raise ValueError(f"layer {name!r} registered in both the MLA and the KDA group")
            self._caches[name] = (GROUP_KDA, t)

    def layer_names(self) -> tuple[str, ...]:
        """Registered layers in the order loads are fetched (registration order: MLA first, then KDA, until
        ``set_layer_order``)."""
        return tuple(self._caches)

    def set_layer_order(self, names: list[str]) -> None:
        """Fetch later loads in ``names``' order (the order the forward reads the layers, so the layer it needs
        next is the one on the wire); names not registered are a ValueError."""
        unknown = [n for n in names if n not in self._caches]
        if unknown:
            raise ValueError(f"set_layer_order: layers {unknown} are not registered")
        self._caches = {**{n: self._caches[n] for n in names}, **self._caches}

    def _index(self, group: str, req: ReqTransfer) -> Any:
        if group == GROUP_MLA:
            return list(req.block_ids)
        if req.kda_slot is None:
            raise ValueError(f"request {req.req_id!r} has KDA layers but no kda_slot")
        return req.kda_slot

    # -- producer ---------------------------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: ConnectorMeta) -> None:
        """Publish the layer's rows of ``meta.saves``: an MLA entry has one row per block (so a consumer can fetch
        from any block on), a KDA entry one row (the slot's state in the TP-1 layout)."""
        if not self.config.is_producer or not meta.saves:
            return
        group, cache = self._caches[layer_name]
        for req in meta.saves:
            local = cache[self._index(group, req)]
            # KDA shards meet on rank 0 (a collective: every rank runs it); the replicated MLA pages need no gather
            full = gather_heads(layer_name, local, self.tp) if group == GROUP_KDA else local
            if self.store is None:
                continue
            rows = full if group == GROUP_MLA else full.unsqueeze(0)  # [blocks, ...] or [1, ...]
            nbytes = self.store.put(entry_key(req.transfer_id, layer_name), rows)
            self.stats.blocks_sent += len(req.block_ids) if group == GROUP_MLA else 1
            self.stats.bytes_sent += nbytes

    def wait_for_save(self) -> None:
        """Saves are synchronous puts into the local store: nothing to wait for."""

    # -- consumer ---------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Start fetching ``meta.loads`` layer by layer on a background thread (in ``layer_names`` order), so the
        forward can copy in and compute layer i while layer i + 1 is on the wire."""
        self._batch = LoadBatch(meta.loads, {name: threading.Event() for name in self._caches})
        if meta.loads:
            threading.Thread(target=self._fetch_all, args=(self._batch,), name="kv-load", daemon=True).start()

    def loading(self) -> bool:
        """A started load has layers not yet copied in."""
        return bool(self._batch.loads) and len(self._batch.waited) < len(self._caches)

    def _fetch_all(self, batch: LoadBatch) -> None:
        loads = batch.loads
        client_of = self._clients(loads)
        try:
            for name in self._caches:
                for req in loads:
                    try:
                        # MLA: only the producer's blocks from first_block on (the rest are cached here)
                        first = req.first_block if self._caches[name][0] == GROUP_MLA else 0
                        got: Any = client_of[req.req_id].get(entry_key(req.transfer_id, name), first)
                    except TransferError as exc:
                        got = exc
                    except Exception as exc:  # noqa: BLE001 (a transport's own error fails the load, never the thread)
                        got = TransferError(f"{type(exc).__name__}: {exc}")
                    with batch.lock:
                        batch.fetched[(req.req_id, name)] = got
                batch.ready[name].set()
            if self.tp.size == 1:  # else rank 0 releases once every rank has fetched (get_finished)
                self._release(loads, client_of)
        finally:
            for client in set(client_of.values()):
                client.close()

    def _clients(self, loads: tuple[ReqTransfer, ...]) -> dict[str, BlockClient]:
        """One client per producer, by request id (a load names its producer; the configured one is the default)."""
        def addr(req: ReqTransfer) -> tuple[str, int]:
            return req.remote_host or self.config.kv_ip, req.remote_port or self.config.kv_port

        clients = {addr(req): self._new_client(*addr(req)) for req in loads}
        return {req.req_id: clients[addr(req)] for req in loads}

    @staticmethod
    def _release(loads: tuple[ReqTransfer, ...], client_of: dict[str, BlockClient]) -> None:
        for req in loads:
            try:
                client_of[req.req_id].release(req.transfer_id)
            except TransferError:
                pass  # the producer's ttl frees it

    def wait_for_layer_load(self, layer_name: str) -> None:
        batch = self._batch
        if not batch.loads or layer_name in batch.waited:
            return
        batch.waited.add(layer_name)
        try:
            self._copy_in(batch, layer_name)
        finally:
            if len(batch.waited) == len(self._caches):
                self._received |= {r.req_id for r in batch.loads if r.req_id not in self._failed}

    def _copy_in(self, batch: LoadBatch, layer_name: str) -> None:
        if all(req.req_id in self._failed for req in batch.loads):
            return  # (a timed-out layer does not make every later one wait again)
        if not batch.ready[layer_name].wait(self.config.timeout_s * (len(batch.loads) + 1)):
            for req in batch.loads:
                self._fail(req.req_id, TransferError(f"timed out loading {layer_name!r}"))
            return
        group, cache = self._caches[layer_name]
        for req in batch.loads:
            if req.req_id in self._failed:
                continue
            with batch.lock:
                got = batch.fetched.pop((req.req_id, layer_name))
            if isinstance(got, TransferError):
                self._fail(req.req_id, got)
                continue
            payload, tmeta = got
            try:
                src = tensor_from_bytes(payload, tmeta)
                if group == GROUP_KDA:  # this rank's heads of the TP-1 layout
                    src = split_heads(layer_name, src[0], self.tp.rank, self.tp.size)
                dst_index = self._index(group, req)
                dst = cache[dst_index]
                if tuple(src.shape) != tuple(dst.shape) or src.dtype != cache.dtype:
                    raise TransferError(f"{layer_name!r}: got {tuple(src.shape)} {src.dtype}, "
                                        f"expected {tuple(dst.shape)} {cache.dtype}")
            except (TransferError, ValueError) as exc:
                self._fail(req.req_id, TransferError(str(exc)))
                continue
            cache[dst_index] = src.to(cache.device)
            self.stats.blocks_received += len(req.block_ids) if group == GROUP_MLA else 1
            self.stats.bytes_received += len(payload)

    def _fail(self, req_id: str, exc: TransferError) -> None:
        if req_id in self._failed:
            return
        self._failed.add(req_id)
        self.stats.failed_transfers += 1
        msg = str(exc)
        if "checksum" in msg:
            self.stats.checksum_failures += 1
        elif "timed out" in msg:
            self.stats.timeouts += 1

    def get_finished(self) -> FinishedTransfers:
        """Under TP > 1 a collective after a step's loads (every rank runs it): the ranks agree on the failed loads
        (every rank has fetched by now), then rank 0 releases the producer's copies."""
        loads = self._batch.loads
        if loads and self.tp.size > 1:
            self._failed = agree_failed(self._failed, self.tp)
            self._received -= self._failed
            if self.tp.is_first:
                client_of = self._clients(loads)
                self._release(loads, client_of)
                for client in set(client_of.values()):
                    client.close()
        self._batch = LoadBatch((), {})
        out = FinishedTransfers(frozenset(self._sent), frozenset(self._received), frozenset(self._failed))
        self._sent, self._received, self._failed = set(), set(), set()
        return out

    def discard_finished(self) -> None:
        """Forget what a step cut short left (its loads, failures, receipts): not a collective."""
        self._batch = LoadBatch((), {})
        self._sent, self._received, self._failed = set(), set(), set()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
