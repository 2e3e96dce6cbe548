"""The worker half a ``--kv-transfer-config`` names (its transport imported only when chosen)."""

from __future__ import annotations

from rocm_k3.kv_transfer.config import KVTransferConfig
from rocm_k3.kv_transfer.socket_connector import SocketConnectorWorker
from rocm_k3.kv_transfer.tp_layout import TPShard


def connector_worker(config: KVTransferConfig, tp: TPShard | None = None) -> SocketConnectorWorker:
    """``SocketConnector`` -> TCP transport; ``NixlConnector`` -> NIXL (the config checked that it imports)."""
    if config.kv_connector == "NixlConnector":
        from rocm_k3.kv_transfer.nixl_connector import NixlConnectorWorker

        return NixlConnectorWorker(config, tp)
    return SocketConnectorWorker(config, tp)
