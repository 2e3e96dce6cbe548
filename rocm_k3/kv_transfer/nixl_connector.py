"""``NixlConnector``: ``SocketConnector``'s connector with the payload bytes moved by NIXL (UCX backend).

Same scheduler half, same per-layer entries with one checksum per block / state, same recompute on a mismatch,
timeout or unreachable producer; only the bulk transfer differs: the producer's published entries are registered
memory that the consumer reads by descriptor (``nixl_transport``).
"""

from __future__ import annotations

from typing import Any

from rocm_k3.kv_transfer.config import KVTransferConfig
from rocm_k3.kv_transfer.nixl_transport import NixlBlockClient, NixlBlockStore, new_agent
from rocm_k3.kv_transfer.socket_connector import SocketConnectorWorker
from rocm_k3.kv_transfer.socket_scheduler import SocketConnectorScheduler as NixlConnectorScheduler  # noqa: F401
from rocm_k3.kv_transfer.socket_transport import BlockClient, BlockStore
from rocm_k3.kv_transfer.tp_layout import TPShard


class NixlConnectorWorker(SocketConnectorWorker):
    """Worker half over NIXL; a consumer's one agent is created with the connector and kept for its lifetime."""

    def __init__(self, config: KVTransferConfig, tp: TPShard | None = None) -> None:
        self._agent: Any = new_agent("consumer", progress_thread=False) if config.is_consumer else None
        self._remotes: dict[tuple[str, int], tuple[str, int]] = {}
        self._late: list[tuple[Any, Any]] = []  # timed-out READs' landing buffers (see NixlBlockClient)
        super().__init__(config, tp)

    def _new_store(self, host: str, port: int, ttl_s: float) -> BlockStore:
        return NixlBlockStore(host, port, ttl_s=ttl_s)

    def _new_client(self, host: str, port: int) -> BlockClient:
        return NixlBlockClient(host, port, self.config.timeout_s, self._agent, self._remotes, self._late)
