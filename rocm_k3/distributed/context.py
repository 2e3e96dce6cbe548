"""ParallelContext: where one rank sits in the tensor / expert / pipeline layout, and its process groups.

Ranks are laid out node-major: global rank = node_rank * gpus_per_node + local_rank. Tensor-parallel groups are
``tp_size`` consecutive ranks (inside a node); pipeline stage ``s`` holds the TP groups ``s`` of every stage
position, and data-parallel replica ``d`` (DP attention) the ``pp_size * tp_size`` ranks from ``d * pp_size *
tp_size``: ``world = dp_size * pp_size * tp_size``, rank ``r`` has ``tp_rank = r % tp_size``, ``pp_rank = r //
tp_size % pp_size``, ``dp_rank = r // (pp_size * tp_size)``. With expert parallelism the routed experts are split
whole over the EP group of TP x DP ranks (every replica's ranks of a stage; DP runs one stage), everything else
keeps its TP sharding inside its replica.

The context is passed into every layer, never read from a global. :meth:`ParallelContext.single` is the
one-process layout and needs no process group (every collective is then the identity).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rocm_k3.checks import check_int
from rocm_k3.settings import EP_DECODE_DISPATCH


class LayoutError(ValueError):
    """A parallel layout that cannot work (sizes that do not divide, more ranks than GPUs, ...)."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The requested layout (validated). ``nnodes`` nodes of ``gpus_per_node`` ranks each run
    ``data_parallel_size x pipeline_parallel_size x tensor_parallel_size`` ranks in all.

    ``data_parallel_size`` N > 1 (DP attention): N replicas of the attention / KDA / dense layers (TP inside each),
    each with its own scheduler and cache, whose MoE layers form one expert-parallel group of N x TP ranks; it needs
    ``enable_expert_parallel`` and one pipeline stage."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0
    expert_placement: str | None = None
    ep_decode_dispatch: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29517
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes"):
            check_int(name, getattr(self, name), error=LayoutError)
        if not isinstance(self.enable_expert_parallel, bool):
            raise LayoutError(f"enable_expert_parallel: expected a bool, got {self.enable_expert_parallel!r}")
        r = check_int("num_redundant_experts", self.num_redundant_experts, 0, error=LayoutError)
        if (r or self.expert_placement is not None) and not self.enable_expert_parallel:
            raise LayoutError("num_redundant_experts / expert_placement need enable_expert_parallel")
        if self.data_parallel_size > 1 and not self.enable_expert_parallel:
            raise LayoutError(f"data_parallel_size={self.data_parallel_size} (DP attention) needs "
                              f"enable_expert_parallel: the replicas' MoE layers form one expert-parallel group "
                              f"(--enable-expert-parallel)")
        if self.data_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise LayoutError("data_parallel_size > 1 runs with pipeline_parallel_size 1 (one expert-parallel group "
                              "per stage is not built)")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise LayoutError("data_parallel_size > 1 runs on one node for now (nnodes must be 1)")
        if r and self.tensor_parallel_size * self.data_parallel_size == 1:
            raise LayoutError("num_redundant_experts: expert parallelism over one rank has nothing to balance "
                              "(tensor_parallel_size must be > 1, or data_parallel_size)")
        if self.ep_decode_dispatch not in EP_DECODE_DISPATCH:
            raise LayoutError(f"ep_decode_dispatch: expected one of {EP_DECODE_DISPATCH}, got "
                              f"{self.ep_decode_dispatch!r}")
        if self.ep_decode_dispatch == "static" and self.data_parallel_size > 1:
            raise LayoutError(f"ep_decode_dispatch='static' with data_parallel_size={self.data_parallel_size}: the "
                              "replicas step with different token counts, so their static capacities would not "
                              "match (use 'auto' or 'dynamic': DP attention decodes on the dynamic dispatch)")
        if self.expert_placement is not None and not isinstance(self.expert_placement, str):
            raise LayoutError(f"expert_placement: expected a path, got {self.expert_placement!r}")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise LayoutError(f"node_rank: expected an int in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise LayoutError(f"master_port: expected a port number, got {self.master_port!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise LayoutError(f"master_addr: expected a host name or address, got {self.master_addr!r}")
        if not self.timeout_s > 0:
            raise LayoutError(f"timeout_s: expected > 0, got {self.timeout_s!r}")
        if self.world_size % self.nnodes:
            raise LayoutError(f"world size dp x tp x pp = {self.world_size} is not a multiple of nnodes={self.nnodes}")
        if self.nnodes > 1 and self.gpus_per_node % self.tensor_parallel_size and \
                self.tensor_parallel_size % self.gpus_per_node:
            raise LayoutError(f"tensor_parallel_size={self.tensor_parallel_size} neither fits in nor spans whole "
                              f"nodes of {self.gpus_per_node} ranks")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.replica_size

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def replica_sampling_rank(self, replica: int) -> int:
        """Global rank that samples for data-parallel ``replica``: TP rank 0 of its last stage."""
        return replica * self.replica_size + (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def node_ranks(self) -> range:
        """Global ranks of this node's processes."""
        start = self.node_rank * self.gpus_per_node
        return range(start, start + self.gpus_per_node)


@dataclasses.dataclass
class ParallelContext:
    """One rank's view of the layout plus its groups (None in the single-process context).

    tp_group / pp_group / world_group: device groups (NCCL on GPUs, gloo on the CPU); *_cpu_group: gloo twins
    for control messages. ``stats`` counts the collectives issued (tests check how many a layer issues), the
    bytes they carried from this rank (``collective_bytes``) and the routed rows it ran (``moe_rows``, beside the
    ``moe_picks`` = T x k of the steps; decode steps on the static-capacity EP dispatch count the rows they run,
    picks or padding, as ``moe_capacity_rows``).
    """

    rank: int = 0  # = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank
    world_size: int = 1  # = dp_size * pp_size * tp_size
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0  # the pipeline stage
    pp_size: int = 1
    dp_rank: int = 0  # the data-parallel (attention) replica
    dp_size: int = 1
    ep_enabled: bool = False
    num_redundant_experts: int = 0
    expert_placement: str | None = None  # a placement file (rocm_k3.model.expert_placement); None = uniform
    ep_decode_dispatch: str = "auto"  # see EP_DECODE_DISPATCH
    tp_group: Any = None
    tp_cpu_group: Any = None
    pp_group: Any = None
    world_cpu_group: Any = None
    dp_ep_group: Any = None  # dp_size > 1: the device group of every replica's ranks (the MoE layers' EP group)
    pp_ranks: tuple[int, ...] = (0,)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def single(cls) -> ParallelContext:
        return cls()

    @property
    def ep_size(self) -> int:
        return self.tp_size * self.dp_size if self.ep_enabled else 1

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank if self.ep_enabled else 0

    @property
    def ep_group(self) -> Any:
        """The group the routed rows travel over: the TP group, or with data parallelism every replica's ranks."""
        return self.dp_ep_group if self.dp_size > 1 else self.tp_group

    @property
    def static_ep_decode(self) -> bool:
        """Decode graphs may move expert-parallel picks on the static-capacity path (``ep_decode_dispatch`` auto
        or static). Only with one data-parallel replica: replicas step with different token counts, so equal-split
        capacities would not match across them; DP attention keeps the dynamic path (and eager decode)."""
        return self.ep_size > 1 and self.ep_decode_dispatch != "dynamic" and self.dp_size == 1

    def static_dispatch_for(self, graphed: bool) -> bool:
        """Whether a decode step (``graphed``: run inside a decode graph) takes the static-capacity dispatch: always
        under ``static``, only in graphs under ``auto`` (an eager step keeps the dynamic path's ~T x k / ep rows
        per rank; the static one runs ~T x k, padding included), never under ``dynamic``."""
        return self.static_ep_decode and (graphed or self.ep_decode_dispatch == "static")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_sampling_rank(self) -> bool:
        """TP rank 0 of the last pipeline stage samples and replies to the scheduler."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def sampling_rank(self) -> int:
        """The global rank that samples for this rank's replica."""
        return (self.dp_rank * self.pp_size + self.pp_size - 1) * self.tp_size

    def count(self, name: str) -> None:
        self.add(name, 1)

    def add(self, name: str, n: int) -> None:
        """Add ``n`` to the counter ``name`` (collectives issued, rows moved, ...)."""
        self.stats[name] = self.stats.get(name, 0) + n

    def shard(self, size: int, what: str, parts: int | None = None, index: int | None = None) -> tuple[int, int]:
        """(start, length) of this rank's equal share of ``size`` along a TP-split dim; LayoutError if uneven."""
        parts = self.tp_size if parts is None else parts
        index = self.tp_rank if index is None else index
        if size % parts:
            raise LayoutError(f"{what} = {size} is not divisible by the {parts} tensor-parallel ranks")
        length = size // parts
        return index * length, length
