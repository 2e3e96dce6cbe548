"""The KV-connector interface, in the shape of vLLM's (``KVConnectorBase_V1``): a scheduler half that decides how
many prompt tokens come from a remote instance, and a worker half that moves the tensors layer by layer.

K3 has two transfer groups: ``GROUP_MLA`` (the prompt's MLA latent KV pages, indexed by block id) and ``GROUP_KDA``
(for each KDA layer the recurrent state and short-conv state at the prompt's last token, indexed by state slot).
Both go through the same calls; a layer's group is fixed at ``register_kv_caches``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

GROUP_MLA = "mla"
GROUP_KDA = "kda"


@dataclasses.dataclass(frozen=True)
class ReqTransfer:
    """One request's part of a step's transfer.

    transfer_id: the key both sides agree on (the producer's request id, passed to the decode request by the
    proxy in ``kv_transfer_params``); block_ids: the request's MLA pages on this instance; kda_slot: its KDA
    state slot on this instance (None for a model without KDA layers); num_tokens: prompt tokens covered.
    first_block: a load's first block in the producer's list (blocks before it the consumer's prefix cache
    already holds; ``block_ids`` then start at that block); remote_host / remote_port: a load's producer.
    """

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    kda_slot: int | None
    num_tokens: int
    first_block: int = 0
    remote_host: str = ""
    remote_port: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")
        if any(b < 0 for b in self.block_ids):
            raise ValueError(f"block_ids must be >= 0, got {self.block_ids}")
        if self.first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {self.first_block}")


@dataclasses.dataclass(frozen=True)
class ConnectorMeta:
    """What the scheduler half hands the worker half for one step: requests to load and requests to save."""

    loads: tuple[ReqTransfer, ...] = ()
    saves: tuple[ReqTransfer, ...] = ()


@dataclasses.dataclass(frozen=True)
class FinishedTransfers:
    """get_finished's answer: saves the consumer confirmed, loads completed, and loads that failed (checksum
    mismatch, timeout, producer gone): the engine must recompute those prompts itself."""

    sent: frozenset[str] = frozenset()
    received: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


class KVConnectorScheduler(abc.ABC):
    """Scheduler half: integers only, no tensors."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, req_id: str, prompt_len: int, num_computed_tokens: int,
                                   kv_transfer_params: dict[str, Any] | None) -> tuple[int, bool]:
        """(tokens the remote instance provides beyond ``num_computed_tokens``, whether they load asynchronously)."""

    @abc.abstractmethod
    def update_state_after_alloc(self, req_id: str, block_ids: tuple[int, ...], kda_slot: int | None,
                                 num_external_tokens: int) -> None:
        """Record where the request's blocks and state slot were allocated, so the load can be scheduled."""

    @abc.abstractmethod
    def build_connector_meta(self) -> ConnectorMeta:
        """The step's loads and saves (clears the pending lists)."""

    @abc.abstractmethod
    def request_finished(self, req_id: str, block_ids: tuple[int, ...], kda_slot: int | None,
                         num_tokens: int) -> tuple[bool, dict[str, Any] | None]:
        """(whether freeing the blocks must wait for a save, kv_transfer_params to return to the client)."""


class KVConnectorWorker(abc.ABC):
    """Worker half: owns the tensors."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, Any], kda_states: dict[str, Any] | None = None) -> None:
        """MLA pages per layer name ([num_blocks, block_size, ...]) and KDA state per name ([num_slots, ...])."""

    @abc.abstractmethod
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Begin loading ``meta.loads`` (asynchronous where the transport allows)."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s data of the started loads is in place (or marked failed)."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, meta: ConnectorMeta) -> None:
        """Publish ``layer_name``'s data for ``meta.saves``."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until the step's saves are published."""

    @abc.abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Transfers that finished (or failed) since the last call."""
