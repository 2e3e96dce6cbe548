"""The vLLM model classes: rocm-k3's :class:`~rocm_k3.model.decoder.KimiModel` (its layers, op table and AttnRes
dataflow) with each KDA sublayer as vLLM's state layer (:mod:`.kda_layer`) and each MLA sublayer's attention in
vLLM's paged ``Attention`` (:mod:`.mla_layer`). vLLM owns scheduling, the KV pages and state slots, sampling and
the server; rocm-k3 owns every tensor op (``rocm_k3.ops.bind``: FlyDSL on ROCm, Triton on CUDA, the reference
backend on the CPU) and the weights, read through rocm-k3's shard rules from vLLM's weight iterator.

Text only. Tensor parallelism (and expert parallelism over the TP ranks) runs over vLLM's own TP group
(:func:`parallel_context`); pipeline parallelism is refused with a ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching

from rocm_k3.checkpoint_errors import MissingTensorError, TensorShapeError, UnexpectedTensorError
from rocm_k3.distributed.context import ParallelContext
from rocm_k3.integrations.vllm.arch import logger
from rocm_k3.integrations.vllm.kda_layer import KDAStateLayer, state_shapes
from rocm_k3.integrations.vllm.config_view import mla_path_here
from rocm_k3.integrations.vllm.mla_layer import ExpandedMLA, LatentMLA, describe_mla_path
from rocm_k3.model.attn_res import StackState, finish, run_layers
from rocm_k3.model.checkpoint_names import canonical_name, expected_tensors
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.decoder import KimiModel
from rocm_k3.model.kda import KDALayer
from rocm_k3.model.loader import check_coverage, fill_target
from rocm_k3.ops.registry import bind


def rocm_config(vllm_config: VllmConfig) -> ModelConfig:
    """rocm-k3's validated config of the served checkpoint: its ``config.json`` when the model is a directory
    (exactly what rocm-k3 itself reads), else vLLM's parsed HF config."""
    model = vllm_config.model_config.model
    if Path(model).is_dir():
        return ModelConfig.from_pretrained(model)
    return ModelConfig.from_hf_dict(vllm_config.model_config.hf_config.to_dict())


def check_supported(vllm_config: VllmConfig) -> None:
    """Refuse, naming the option, what the plugin's model does not run: speculative decoding (the KDA layer keeps
    one state per sequence, no per-draft-token states), KV-transfer (PD) connectors (the KDA state is not described
    to them) and CUDA graphs (the model runs eager: pass ``--enforce-eager``)."""
    if vllm_config.speculative_config is not None:
        raise ValueError("rocm-k3's vLLM plugin does not support speculative decoding yet (drop --speculative-config)")
    if vllm_config.kv_transfer_config is not None:
        raise ValueError("rocm-k3's vLLM plugin does not support KV-transfer connectors (PD disaggregation) yet "
                         "(drop --kv-transfer-config)")
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.name != "NONE":
        raise ValueError(f"rocm-k3's vLLM plugin runs its model eagerly; vLLM chose CUDA graph mode {mode.name}: pass "
                         f"--enforce-eager (LLM(..., enforce_eager=True))")


def parallel_context(vllm_config: VllmConfig) -> ParallelContext:
    """rocm-k3's layout for this vLLM worker: vLLM's tensor-parallel group (its device and gloo groups, so no second
    process group is created), experts split whole over it with ``--enable-expert-parallel``. Pipeline parallelism
    is refused (ValueError): the plugin's model is one stage."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(f"rocm-k3's vLLM plugin: pipeline_parallel_size={parallel.pipeline_parallel_size} is not "
                         f"supported (use `rocm-k3 serve -tp N -pp M` for pipeline stages)")
    if parallel.tensor_parallel_size == 1:
        return ParallelContext.single()
    from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group

    group = get_tp_group()
    rank, size = get_tensor_model_parallel_rank(), parallel.tensor_parallel_size
    return ParallelContext(rank=rank, world_size=size, tp_rank=rank, tp_size=size,
                           ep_enabled=bool(parallel.enable_expert_parallel), tp_group=group.device_group,
                           tp_cpu_group=group.cpu_group, world_cpu_group=group.cpu_group)


class RocmK3ForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMambaPrefixCaching):
    """Kimi K3 / Kimi Linear text generation in vLLM on rocm-k3's layers (see the module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        check_supported(vllm_config)
        cfg = rocm_config(vllm_config)
        self.cfg = cfg
        dtype = vllm_config.model_config.dtype
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        table = bind(device, None)  # ROCM_K3_BACKEND, else the device's automatic choice
        self.model = KimiModel(cfg, parallel_context(vllm_config), table, dtype=dtype, device=device)
        path = mla_path_here(vllm_config.model_config.hf_text_config)
        if path.latent != vllm_config.model_config.use_mla:
            raise ValueError(f"vLLM's model config has use_mla={vllm_config.model_config.use_mla} but the plugin "
                             f"chose the {path.name} MLA path ({path.reason}): is the rocm-k3 config view registered?")
        mla_cls = LatentMLA if path.latent else ExpandedMLA
        for layer in self.model.layers:
            name = f"model.layers.{layer.index}.self_attn"
            if isinstance(layer.attn, KDALayer):
                layer.attn = KDAStateLayer(layer.attn, vllm_config, name)
            else:
                layer.attn = mla_cls(layer.attn, vllm_config, name)
        mla = next((lay.attn for lay in self.model.layers if isinstance(lay.attn, mla_cls)), None)
        self.mla_path = path
        logger.info("rocm-k3 vLLM plugin: %s layers on the %r op table (%s)", cfg.model_type, table.backend,
                    describe_mla_path(path, mla))

    # ------------------------------------------------------------------ vLLM's model interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)  # [T, hidden]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **_kwargs) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the step's tokens (positions: NoPE, unused)."""
        m, cfg = self.model, self.cfg
        x = inputs_embeds if inputs_embeds is not None else m.embed(input_ids)  # [T, hidden]
        state = StackState.start(x, cfg.num_hidden_layers, cfg.attn_res_block_size)
        state = run_layers(state, list(m.layers), cfg.attn_res_block_size, cfg.rms_norm_eps, m.backend)
        return finish(state, m.output_site, m.final_norm, cfg.rms_norm_eps, m.backend)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden_states)  # fp32 [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill rocm-k3's parameters from vLLM's (name, tensor) iterator through the layers' shard rules; every
        checkpoint tensor is checked against the config (named errors for missing, unexpected or mis-shaped
        tensors), then the layers finish loading (experts re-laid for the serving backend)."""
        cfg = self.cfg
        targets = self.model.weight_targets()
        check_coverage(self.model, targets)
        expected = expected_tensors(cfg)
        seen: set[str] = set()
        for name, tensor in weights:
            canon = canonical_name(cfg, name)
            if canon is None:
                continue  # vision tower: not part of the text model
            spec = expected.get(canon)
            if spec is None:
                raise UnexpectedTensorError(f"unexpected tensor in the checkpoint: {name}")
            if not spec.accepts(tuple(tensor.shape)):
                raise TensorShapeError(f"{name}: expected shape {list(spec.shape)}, got {list(tensor.shape)}")
            target = targets.get(canon)
            if target is None:
                continue  # another rank's expert (expert parallelism)
            fill_target(cfg, canon, name, target, tensor[target.read.index(tensor.dim())])
            seen.add(canon)
        missing = sorted(set(targets) - seen)
        if missing:
            raise MissingTensorError(f"{len(missing)} tensors missing from the checkpoint: {missing[:12]}")
        self.model.post_load()
        return {name for name, _ in self.named_parameters()}

    # ------------------------------------------------------------------ the hybrid state (IsHybrid)
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        kda = rocm_config(vllm_config).kda
        heads = kda.num_heads // vllm_config.parallel_config.tensor_parallel_size
        return state_shapes(heads, kda.head_dim, kda.conv_kernel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return vllm_config.model_config.dtype, torch.float32  # conv state in the model dtype, recurrent fp32

    @classmethod
    def get_mamba_state_copy_func(cls):
        """'align' prefix caching copies each state of a slot whole (conv ``[C, W-1]``, recurrent ``[Hl, D, D]``)."""
        return get_temporal_copy_spec, get_temporal_copy_spec


class RocmK3KimiK3ForConditionalGeneration(RocmK3ForCausalLM):
    """Kimi K3 (``language_model.``-prefixed text model; the vision tower is not served by the plugin)."""


class RocmK3KimiLinearForCausalLM(RocmK3ForCausalLM):
    """Kimi Linear (the same text model with the plain residual, no AttnRes)."""
