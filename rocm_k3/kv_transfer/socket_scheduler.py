"""The scheduler half of ``SocketConnector`` (integers only: the engine imports it, no tensors).

Boundary convention (pinned, see ../shared/PARALLEL_SPEC.md section 5): a prompt of N tokens transfers the MLA
latent KV of its first N - 1 tokens and, for every KDA layer, the recurrent and short-conv state after token
N - 2 (the state before the last prompt token). The consumer computes the last prompt token itself, which gives
it the logits of its first generated token; no token is ever processed twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rocm_k3.kv_transfer.base import ConnectorMeta, KVConnectorScheduler, ReqTransfer
from rocm_k3.kv_transfer.config import KVTransferConfig


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """A consumer request's ``kv_transfer_params``, checked: where its prompt's cache is and how much of it."""

    transfer_id: str
    num_tokens: int
    host: str
    port: int


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The remote prefill ``params`` name (None when they name none: no params, or a producer's
    ``do_remote_decode``); a ValueError naming the key for malformed ones."""
    if not params or "remote_transfer_id" not in params:
        return None
    rid, num = params.get("remote_transfer_id"), params.get("remote_num_tokens")
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"kv_transfer_params.remote_transfer_id: expected a non-empty str, got {rid!r}")
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"kv_transfer_params.remote_num_tokens: expected an int >= 0, got {num!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"kv_transfer_params.remote_host: expected a host name, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port: expected an int in [1, 65535], got {port!r}")
    return RemotePrefill(rid, num, host, port)


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """The client asked this (producer) instance to publish the prompt's cache for a decode instance."""
    return bool(params) and params.get("do_remote_decode") is True


class SocketConnectorScheduler(KVConnectorScheduler):
    """Consumer: a request whose ``kv_transfer_params`` name a remote prefill gets its tokens from it.
    Producer: a request with ``do_remote_decode`` publishes its prompt's cache (copied into the producer's store,
    which keeps it until the consumer confirms or ``timeout_s`` ends) and returns where to fetch it."""

    def __init__(self, config: KVTransferConfig, block_size: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config
        self.block_size = block_size
        self._pending: dict[str, tuple[RemotePrefill, int]] = {}
        self._loads: list[ReqTransfer] = []
        self._saves: list[ReqTransfer] = []

    def get_num_new_matched_tokens(self, req_id: str, prompt_len: int, num_computed_tokens: int,
                                   kv_transfer_params: dict[str, Any] | None) -> tuple[int, bool]:
        remote = remote_prefill(kv_transfer_params) if self.config.is_consumer else None
        if remote is None:
            return 0, False
        num = max(0, min(remote.num_tokens, prompt_len - 1) - num_computed_tokens)
        if num:
            self._pending[req_id] = (remote, num_computed_tokens)
        return num, False

    def update_state_after_alloc(self, req_id: str, block_ids: tuple[int, ...], kda_slot: int | None,
                                 num_external_tokens: int) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is None or num_external_tokens == 0:
            return
        remote, computed = pending
        first = computed // self.block_size
        last = -(-(computed + num_external_tokens) // self.block_size)
        self._loads.append(ReqTransfer(req_id, remote.transfer_id, tuple(block_ids[first:last]), kda_slot,
                                       computed + num_external_tokens, first_block=first,
                                       remote_host=remote.host, remote_port=remote.port))

    def forget(self, req_id: str) -> None:
        """Drop what is pending for a request that ended (aborted between its match and its allocation)."""
        self._pending.pop(req_id, None)

    def add_save(self, req: ReqTransfer) -> None:
        """Producer: publish ``req``'s blocks and state slot in this step (before its forward)."""
        if self.config.is_producer:
            self._saves.append(req)

    def build_connector_meta(self) -> ConnectorMeta:
        meta = ConnectorMeta(loads=tuple(self._loads), saves=tuple(self._saves))
        self._loads, self._saves = [], []
        return meta

    def request_finished(self, req_id: str, block_ids: tuple[int, ...], kda_slot: int | None,
                         num_tokens: int) -> tuple[bool, dict[str, Any] | None]:
        """The store holds a copy of the published cache, so the blocks are freed at once (False); the params say
        where the decode instance fetches it."""
        if not self.config.is_producer:
            return False, None
        return False, {"remote_transfer_id": req_id, "remote_num_tokens": num_tokens,
                       "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port}
