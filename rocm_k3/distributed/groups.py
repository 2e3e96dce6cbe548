"""Process-group construction on torch.distributed (torchrun-compatible ``env://`` init).

One process per rank. The default group uses "nccl" on GPUs (NCCL on NVIDIA, RCCL on ROCm: the same backend
name) and "gloo" on the CPU; a gloo twin of the world group carries control messages (the step broadcast).
Groups: TP = ``tp_size`` consecutive ranks (inside a node), PP = ranks with the same TP rank across stages, both
inside one data-parallel replica; with ``data_parallel_size`` > 1 the MoE layers' EP group spans every rank.
Every rank must create every group in the same order (torch.distributed's rule), which :func:`init_parallel`
does.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from rocm_k3.distributed.context import LayoutError, ParallelConfig, ParallelContext

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
LOOPBACK_IFNAME = "lo"  # Linux's loopback interface (gloo's pairs of a one-node group bind there)


def rank_env(config: ParallelConfig, rank: int) -> dict[str, str]:
    """The torchrun-style environment of one rank of ``config``."""
    return {"MASTER_ADDR": config.master_addr, "MASTER_PORT": str(config.master_port), "RANK": str(rank),
            "WORLD_SIZE": str(config.world_size), "LOCAL_RANK": str(rank % config.gpus_per_node)}


def init_parallel(config: ParallelConfig, env: Mapping[str, str], device_type: str,
                  store_file: str | None = None) -> ParallelContext:
    """Join the process group described by ``env`` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and
    build this rank's groups. ``device_type`` "cuda" selects NCCL/RCCL for the device groups, "cpu" gloo.

    ``store_file``: the ranks of one node meet through this FileStore instead of a TCP store at MASTER_ADDR, and
    gloo binds to the loopback interface (unless ``GLOO_SOCKET_IFNAME`` is set), so nothing listens beyond
    127.0.0.1."""
    missing = [k for k in ENV_KEYS if k not in env]
    if missing:
        raise LayoutError(f"distributed init needs {missing} in the environment (torchrun sets them)")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world != config.world_size:
        raise LayoutError(f"WORLD_SIZE={world} does not match data_parallel_size x tensor_parallel_size x "
                          f"pipeline_parallel_size = {config.world_size}")
    if not 0 <= rank < world:
        raise LayoutError(f"RANK={rank} outside [0, WORLD_SIZE={world})")
    if device_type == "cuda":
        local = int(env["LOCAL_RANK"])
        count = torch.cuda.device_count()
        if local >= count:
            raise LayoutError(f"LOCAL_RANK={local} but this node has {count} GPU(s): tensor_parallel_size x "
                              f"pipeline_parallel_size / nnodes must not exceed the GPUs of a node")
        torch.cuda.set_device(local)  # before the NCCL group, so each rank binds its own GPU
    os.environ.update({k: env[k] for k in ENV_KEYS})  # env:// reads the process environment
    timeout = datetime.timedelta(seconds=config.timeout_s)
    backend = "nccl" if device_type == "cuda" else "gloo"
    init_method = "env://"
    if store_file is not None:
        init_method = f"file://{store_file}"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    world_cpu = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    tp, pp, dp = config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size
    ctx = ParallelContext(rank=rank, world_size=world, tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp % pp,
                          pp_size=pp, dp_rank=rank // (tp * pp), dp_size=dp, ep_enabled=config.enable_expert_parallel,
                          world_cpu_group=world_cpu, num_redundant_experts=config.num_redundant_experts,
                          expert_placement=config.expert_placement, ep_decode_dispatch=config.ep_decode_dispatch)
    for replica in range(dp):  # every rank creates every group, in the same order
        base = replica * tp * pp
        for stage in range(pp):
            ranks = list(range(base + stage * tp, base + (stage + 1) * tp))
            group = dist.new_group(ranks, timeout=timeout)
            cpu = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if (replica, stage) == (ctx.dp_rank, ctx.pp_rank):
                ctx.tp_group, ctx.tp_cpu_group = (group if tp > 1 else None), cpu
        for t in range(tp):
            ranks = [base + stage * tp + t for stage in range(pp)]
            group = dist.new_group(ranks, timeout=timeout)
            if (replica, t) == (ctx.dp_rank, ctx.tp_rank):
                ctx.pp_group = group if pp > 1 else None
                ctx.pp_ranks = tuple(ranks)
    if dp > 1:  # the MoE layers' expert-parallel group: every replica's ranks (one stage)
        ctx.dp_ep_group = dist.new_group(list(range(world)), timeout=timeout)
    return ctx


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def reduce_ints(values: list[int], group, op: str) -> list[int]:
    """``values`` reduced element-wise over ``group`` ("max" or "min"); the identity without a group."""
    if group is None:
        return list(values)
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"reduce_ints: op must be one of {sorted(ops)}, got {op!r}")
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=ops[op], group=group)
    return [int(v) for v in t.tolist()]
