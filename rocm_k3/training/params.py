"""The trainable tensors of a K3 checkpoint, by checkpoint name, and their conversions.

Training keeps every tensor in fp32 under its checkpoint name (``cfg.weight_prefix`` + canonical name), with the
routed experts dense (``...experts.E.w{1,2,3}.weight``, the unquantised layout of the same checkpoint). Writing a
checkpoint quantises the experts to MXFP4 (``weight_packed`` + ``weight_scale``, compressed-tensors rule), as the
released K3 stores them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from rocm_k3 import ops
from rocm_k3.model.checkpoint_names import canonical_name, expected_tensors
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.loader import checkpoint_files, plan_load
from rocm_k3.model.tiny import storage_form

_EXPERT = re.compile(r"^(.*\.experts\.\d+\.w[123])\.(weight|weight_packed|weight_scale)$")
# tensors that are not trained by gradient descent: the router's selection bias (balanced by its own rule)
FROZEN_SUFFIXES = ("gate.e_score_correction_bias",)


def dense_expert_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with unquantised routed experts (the layout training works in)."""
    return dataclasses.replace(cfg, expert_format="bf16")


def stored_shape(cfg: ModelConfig, canon: str, spec_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a checkpoint stores tensor ``canon`` in: its spec's, except K3's ``A_log``, stored as
    ``[head_dim]`` (the H per-head values, then zero padding)."""
    return (cfg.kda.head_dim,) if cfg.is_k3 and canon.endswith("A_log") else spec_shape


def init_params(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded fp32 initial weights for every tensor of ``cfg`` (dense experts), by checkpoint name.

    Linear weights ~ N(0, 1/fan_in) (output projections of each sublayer scaled by 1/sqrt(2 * layers)); norms 1;
    AttnRes projections 0 (a uniform mix over depth at the start); embeddings N(0, 1); router bias 0. KDA decay:
    with K3's safe gate ``g = L * sigmoid(exp(A_log) * (f + dt_bias))``, A_log = 0 and dt_bias set so that the
    per-token decay of each channel is log-uniform between exp(-0.7) and exp(-0.001) (the softplus-gate
    initialisation, A = U(1, 16) and dt = logU(1e-3, 1e-1), would make every channel start with almost no decay
    under the safe gate, and Adam needs thousands of steps to move dt_bias by several units); Kimi Linear's
    softplus gate keeps that released initialisation.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    safe_gate = cfg.kda.gate_lower_bound is not None
    depth_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, spec in expected_tensors(dense_expert_config(cfg)).items():
        shape = spec.shape
        if name.endswith(("norm.weight", "layernorm.weight")):
            t = torch.ones(shape)
        elif name.endswith("_res_proj.weight") or name.endswith(FROZEN_SUFFIXES):
            t = torch.zeros(shape)
        elif name.endswith("A_log"):
            if safe_gate:  # a = exp(A_log) = 1: the decay is set by dt_bias alone
                t = torch.zeros(shape)
            else:
                t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
            t = torch.cat([t.reshape(-1)[:cfg.kda.num_heads], torch.zeros(cfg.kda.head_dim)])[
                :math.prod(stored_shape(cfg, name, shape))].reshape(stored_shape(cfg, name, shape))
        elif name.endswith("dt_bias"):
            if safe_gate:  # per-token log-decay L * sigmoid(dt_bias) log-uniform in -[1e-3, 0.7]: memories of
                # about 1.5 to 1000 tokens, so some channels track the last few tokens from the first step
                g = torch.empty(shape).uniform_(math.log(1e-3), math.log(0.7), generator=gen).exp()
                t = torch.logit(g / -cfg.kda.gate_lower_bound)
            else:
                dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
                t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight", "routed_expert_up_proj.weight")):
                t = t * depth_scale
        out[cfg.weight_prefix + name] = t
    return out


def is_trainable(name: str) -> bool:
    return not name.endswith(FROZEN_SUFFIXES)


def load_params(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, fp32 tensors by checkpoint name with dense experts) of a checkpoint directory; MXFP4 experts are
    dequantised exactly (every MXFP4 value is an fp32 value), names are the canonical ones (with the K3 prefix),
    the vision tower is left out."""
    cfg = ModelConfig.from_pretrained(path)
    files = checkpoint_files(path)
    plan_load(cfg, files)  # every tensor the config implies, with its shape and dtype (named errors)
    raw: dict[str, torch.Tensor] = {}
    for file in files.files:
        raw.update(load_file(str(file)))
    out: dict[str, torch.Tensor] = {}
    for stored, t in raw.items():
        canon = canonical_name(cfg, stored)
        if canon is None:
            continue  # the vision tower
        name = cfg.weight_prefix + canon
        m = _EXPERT.match(name)
        if m is None or m.group(2) == "weight":
            out[name] = t.float()
        elif m.group(2) == "weight_packed":
            scales = raw[stored[:-len("weight_packed")] + "weight_scale"]
            out[m.group(1) + ".weight"] = ops.dequantize_mxfp4(t, scales, torch.float32)
    return cfg, out


def quantised_experts(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with every dense expert weight replaced by its MXFP4 round trip (what the checkpoint holds)."""
    out = dict(params)
    for name, t in params.items():
        if _EXPERT.match(name):
            packed, scales = ops.quantize_mxfp4(t.detach().float(), rule="ct")
            out[name] = ops.dequantize_mxfp4(packed, scales, torch.float32)
    return out


def checkpoint_tensors(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to write: everything as it is (the writer stores bf16 / fp32), experts as MXFP4 bytes."""
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        m = _EXPERT.match(name)
        t = t.detach().float().contiguous()
        if m is None:
            out[name] = t
        else:
            packed, scales = ops.quantize_mxfp4(t, rule="ct")
            out[m.group(1) + ".weight_packed"] = packed
            out[m.group(1) + ".weight_scale"] = scales
    return out


def bf16_round_trip(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` as the checkpoint stores them (:func:`rocm_k3.model.tiny.storage_form`), back in fp32."""
    return {n: storage_form(n, t.detach()).float() for n, t in params.items()}
