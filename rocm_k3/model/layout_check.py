"""Whether a model can be split as asked: every dim a layout divides must divide (checked before any process
starts, so an impossible layout is one named error instead of a failure inside a worker)."""

from __future__ import annotations

from rocm_k3.distributed.context import LayoutError, ParallelConfig
from rocm_k3.model.config import ModelConfig

MXFP4_GROUP = 32


def check_layout(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise LayoutError naming every dim of ``cfg`` that ``parallel`` cannot split."""
    tp, pp, dp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.data_parallel_size
    ep = tp * dp if parallel.enable_expert_parallel else 1
    problems = []

    def divides(value: int, what: str, by: int = tp, unit: int = 1) -> None:
        if value % by or (value // by) % unit:
            extra = f" into multiples of {unit}" if unit > 1 else ""
            problems.append(f"{what} = {value} does not split over {by} ranks{extra}")

    if pp > cfg.num_hidden_layers:
        problems.append(f"pipeline_parallel_size={pp} exceeds num_hidden_layers={cfg.num_hidden_layers}")
    has_moe = any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if dp > 1 and not has_moe:
        problems.append("data_parallel_size > 1 (DP attention with expert-parallel MoE) needs MoE layers; this model "
                        "has none")
    if has_moe and ep > 1:
        divides(cfg.num_experts + parallel.num_redundant_experts,
                "num_experts + num_redundant_experts (expert parallelism)", by=ep)
    if tp > 1:
        if cfg.kda_layers:
            divides(cfg.kda.num_heads, "linear_attn_config.num_heads (KDA heads)")
        if cfg.mla_layers:
            divides(cfg.num_attention_heads, "num_attention_heads (MLA heads)")
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            divides(cfg.intermediate_size, "intermediate_size (dense MLP)")
        if has_moe:
            if not parallel.enable_expert_parallel:
                unit = MXFP4_GROUP if cfg.expert_format == "mxfp4" else 1
                divides(cfg.moe_intermediate_size, "moe_intermediate_size (routed experts)", unit=unit)
            if cfg.num_shared_experts:
                divides(cfg.moe_intermediate_size * cfg.num_shared_experts, "shared experts' intermediate size")
            if cfg.routed_expert_hidden_size is not None:
                divides(cfg.hidden_size, "hidden_size (the LatentMoE up-projection's column shards)")
    if problems:
        dp_text = f"data_parallel_size={dp} x " if dp > 1 else ""
        raise LayoutError(f"cannot run {dp_text}tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
                          f"{' with expert parallelism' if parallel.enable_expert_parallel else ''}: "
                          + "; ".join(problems))
