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


def tensor_to_bytes(t: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes(), {"dtype": str(t.dtype).removeprefix("torch."),
                                                   "shape": list(t.shape)}


def tensor_from_bytes(payload: bytes, meta: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, meta["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {meta['dtype']!r} in transfer")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(meta["shape"])


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
        self.store = BlockStore(config.kv_ip, config.kv_port, ttl_s=ttl_s) if publishes else None
        self._lock = threading.Lock()
        self._fetched: dict[tuple[str, str], tuple[bytes, dict[str, Any]] | TransferError] = {}
        self._layer_ready: dict[str, threading.Event] = {}
        self._loads: tuple[ReqTransfer, ...] = ()
        self._failed: set[str] = set()
        self._received: set[str] = set()
        self._sent: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any], kda_states: dict[str, Any] | None = None) -> None:
        for name, t in kv_caches.items():
            self._caches[name] = (GROUP_MLA, t)
        for name, t in (kda_states or {}).items():
            if name in self._caches:
                raise ValueError(f"layer {name!r} registered in both the MLA and the KDA group")
            self._caches[name] = (GROUP_KDA, t)

    def layer_names(self) -> tuple[str, ...]:
        """Registered layers in registration order (MLA first, then KDA): the order loads arrive in."""
        return tuple(self._caches)

    def _index(self, group: str, req: ReqTransfer) -> Any:
        if group == GROUP_MLA:
            return list(req.block_ids)
        if req.kda_slot is None:
            raise ValueError(f"request {req.req_id!r} has KDA layers but no kda_slot")
        return req.kda_slot

    # -- producer ---------------------------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: ConnectorMeta) -> None:
        if not self.config.is_producer or not meta.saves:
            return
        group, cache = self._caches[layer_name]
        for req in meta.saves:
            local = cache[self._index(group, req)]
            # KDA shards meet on rank 0 (a collective: every rank runs it); the replicated MLA pages need no gather
            full = gather_heads(layer_name, local, self.tp) if group == GROUP_KDA else local
            if self.store is None:
                continue
            payload, tmeta = tensor_to_bytes(full)
            self.store.put(entry_key(req.transfer_id, layer_name), payload, tmeta)
            self.stats.blocks_sent += len(req.block_ids) if group == GROUP_MLA else 1
            self.stats.bytes_sent += len(payload)

    def wait_for_save(self) -> None:
        """Saves are synchronous puts into the local store: nothing to wait for."""

    # -- consumer ---------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        self._loads = meta.loads
        self._fetched = {}
        self._layer_ready = {name: threading.Event() for name in self._caches}
        if not meta.loads:
            for ev in self._layer_ready.values():
                ev.set()
            return
        threading.Thread(target=self._fetch_all, args=(meta.loads,), name="kv-load", daemon=True).start()

    def _fetch_all(self, loads: tuple[ReqTransfer, ...]) -> None:
        client_of = self._clients(loads)
        try:
            for name in self._caches:
                for req in loads:
                    try:
                        got: Any = client_of[req.req_id].get(entry_key(req.transfer_id, name))
                    except TransferError as exc:
                        got = exc
                    with self._lock:
                        self._fetched[(req.req_id, name)] = got
                self._layer_ready[name].set()
            if self.tp.size == 1:  # else rank 0 releases once every rank has fetched (get_finished)
                self._release(loads, client_of)
        finally:
            for client in set(client_of.values()):
                client.close()

    def _clients(self, loads: tuple[ReqTransfer, ...]) -> dict[str, BlockClient]:
        """One client per producer, by request id (a load names its producer; the configured one is the default)."""
        def addr(req: ReqTransfer) -> tuple[str, int]:
            return req.remote_host or self.config.kv_ip, req.remote_port or self.config.kv_port

        clients = {addr(req): BlockClient(*addr(req), self.config.timeout_s) for req in loads}
        return {req.req_id: clients[addr(req)] for req in loads}

    @staticmethod
    def _release(loads: tuple[ReqTransfer, ...], client_of: dict[str, BlockClient]) -> None:
        for req in loads:
            try:
                client_of[req.req_id].release(req.transfer_id)
            except TransferError:
                pass  # the producer's ttl frees it

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        ready = self._layer_ready[layer_name]
        if not ready.wait(self.config.timeout_s * (len(self._loads) + 1)):
            for req in self._loads:
                self._fail(req.req_id, TransferError(f"timed out loading {layer_name!r}"))
            return
        group, cache = self._caches[layer_name]
        for req in self._loads:
            if req.req_id in self._failed:
                continue
            with self._lock:
                got = self._fetched.pop((req.req_id, layer_name))
            if isinstance(got, TransferError):
                self._fail(req.req_id, got)
                continue
            payload, tmeta = got
            try:
                src = tensor_from_bytes(payload, tmeta)
                if group == GROUP_MLA:  # the producer's blocks from first_block on (the rest are cached here)
                    src = src[req.first_block : req.first_block + len(req.block_ids)]
                else:  # this rank's heads of the TP-1 layout
                    src = split_heads(layer_name, src, self.tp.rank, self.tp.size)
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
        if layer_name == next(reversed(self._caches)):
            self._received |= {r.req_id for r in self._loads if r.req_id not in self._failed}

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
        if self._loads and self.tp.size > 1:
            self._failed = agree_failed(self._failed, self.tp)
            self._received -= self._failed
            if self.tp.is_first:
                client_of = self._clients(self._loads)
                self._release(self._loads, client_of)
                for client in set(client_of.values()):
                    client.close()
        self._loads = ()
        out = FinishedTransfers(frozenset(self._sent), frozenset(self._received), frozenset(self._failed))
        self._sent, self._received, self._failed = set(), set(), set()
        return out

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
