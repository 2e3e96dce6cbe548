"""The MoonViT tower: patch embedding, position table, pre-norm encoder blocks, final norm, 2x2 patch merger.

Dataflow for images packed along the patch axis (SERVING_SPEC 6.2), N = sum of h*w over the images:

    pixel_values [N, 3, p, p] -> patch_embed.proj (the stride-p conv as one GEMM over flattened patches)
        + patch_embed.pos_emb (table resampled per image)                                      [N, D]
    blocks: x += wo(varlen_attention(rope2d(q), rope2d(k), v))  with q|k|v = wqkv(norm0(x))  [N, H, Dh] each
            x += mlp.fc1(gelu_tanh(mlp.fc0(norm1(x))))
    final_layernorm                                                                          [N, D]
    sd2_tpool merge, per image: [h*w, D] -> [(h/kh)*(w/kw), kh*kw, D]

Attention is bidirectional within each image only (``cu_seqlens``, one sequence per image) with scale Dh^-0.5.
Parameter names are the checkpoint's (``patch_embed.proj.weight``, ``encoder.blocks.{i}.wqkv.weight``, ...)
under the ``vision_tower.`` prefix, so a state dict loads directly. ``forward`` returns one tensor per image,
so any subset of images can run on a rank and the results be gathered (:mod:`rocm_k3.model.vision.data_parallel`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from rocm_k3 import ops
from rocm_k3.model.vision.config import VisionConfig
from rocm_k3.model.vision.layers import VisionNorm, linear
from rocm_k3.model.vision.pos_emb import PositionTable
from rocm_k3.model.vision.rope import apply_rope_2d, rope_2d_angles

Grid = tuple[int, int, int]


class VisionInputError(ValueError):
    """pixel_values / grid_thws that do not describe a batch of images this tower can run."""


def as_grids(grid_thws: Sequence[Sequence[int]] | torch.Tensor, cfg: VisionConfig) -> list[Grid]:
    """``grid_thws`` (a [n, 3] int tensor or rows of (t, h, w)) as host tuples, checked against the config."""
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else list(grid_thws)
    kh, kw = cfg.merge_kernel_size
    grids = []
    for i, row in enumerate(rows):
        try:
            if len(row) != 3 or any(isinstance(v, bool) for v in row):
                raise TypeError
            t, h, w = (operator.index(v) for v in row)  # ints, numpy ints, 0-d int tensors
        except TypeError:
            raise VisionInputError(f"grid_thws[{i}]: expected three integers (t, h, w), got {row!r}") from None
        if t != 1:
            raise VisionInputError(f"grid_thws[{i}]: t = {t}; rocm-k3 serves images (t = 1) only, not video")
        if h < 1 or w < 1 or h % kh or w % kw:
            raise VisionInputError(
                f"grid_thws[{i}]: the patch grid {h} x {w} must be positive multiples of the merge kernel {kh} x {kw}"
            )
        grids.append((t, h, w))
    return grids


def check_pixel_values(pixel_values: object, grids: Sequence[Grid], cfg: VisionConfig) -> torch.Tensor:
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"pixel_values must be a torch.Tensor, got {type(pixel_values).__name__}")
    if not pixel_values.dtype.is_floating_point:
        raise TypeError(f"pixel_values must be a floating tensor, got {pixel_values.dtype}")
    n = sum(t * h * w for t, h, w in grids)
    p = cfg.patch_size
    if tuple(pixel_values.shape) != (n, 3, p, p):
        raise VisionInputError(
            f"pixel_values must have shape [sum(t*h*w), 3, {p}, {p}] = [{n}, 3, {p}, {p}] for grid_thws "
            f"{list(grids)}, got {list(pixel_values.shape)}"
        )
    return pixel_values


class PatchProjection(nn.Module):
    """The stride-p patch conv ``weight [D, 3, p, p]`` (+ bias [D]) applied as one GEMM over flattened patches."""

    def __init__(self, dim: int, patch_size: int, bias: bool, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, 3, patch_size, patch_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # a conv whose kernel and stride equal the input size: out[n, d] = sum_{c,i,j} W[d, c, i, j] x[n, c, i, j]
        return F.linear(pixels.flatten(1), self.weight.flatten(1), self.bias)  # [N, 3*p*p] -> [N, D]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.proj = PatchProjection(cfg.hidden_size, cfg.patch_size, cfg.patch_embed_proj_bias, device, dtype)
        self.pos_emb = PositionTable(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size,
                                     cfg.pos_emb_interpolation_mode, device=device, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x = self.proj(pixel_values.to(self.proj.weight.dtype))  # [N, D]
        return x + self.pos_emb(grids).to(x.dtype)


class EncoderMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.fc0 = linear(cfg.hidden_size, cfg.intermediate_size, cfg.linear_bias, device, dtype)
        self.fc1 = linear(cfg.intermediate_size, cfg.hidden_size, cfg.linear_bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class EncoderBlock(nn.Module):
    """One pre-norm block: attention with 2-D RoPE within each image, then the GELU-tanh MLP."""

    def __init__(self, cfg: VisionConfig, backend: str | None, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        d, q = cfg.hidden_size, cfg.qkv_hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.backend = backend
        self.norm0 = VisionNorm(cfg.norm_type, d, cfg.norm_eps, backend=backend, device=device, dtype=dtype)
        self.norm1 = VisionNorm(cfg.norm_type, d, cfg.norm_eps, backend=backend, device=device, dtype=dtype)
        self.wqkv = linear(d, 3 * q, cfg.attn_bias, device, dtype)  # rows q | k | v, each H * Dh
        self.wo = linear(q, d, cfg.attn_bias, device, dtype)
        self.mlp = EncoderMLP(cfg, device, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).view(n, 3, self.num_heads, self.head_dim)  # [N, 3, H, Dh]
        q, k, v = qkv.unbind(dim=1)
        q, k = apply_rope_2d(q, *rope), apply_rope_2d(k, *rope)
        attn = ops.varlen_attention(q, k, v, cu_seqlens, scale=self.head_dim ** -0.5, max_seqlen=max_seqlen,
                                    backend=self.backend)  # [N, H, Dh]
        x = x + self.wo(attn.reshape(n, self.num_heads * self.head_dim))
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig, backend: str | None, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg, backend, device, dtype) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = VisionNorm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps, backend=backend,
                                          device=device, dtype=dtype)


def sd2_tpool_merge(x: torch.Tensor, grids: Sequence[Grid], kernel: tuple[int, int]) -> list[torch.Tensor]:
    """Per image ``[t*h*w, D]`` -> ``[(h/kh)*(w/kw), kh*kw, D]``: mean over t, then each kh x kw neighbourhood.

    Output tokens are row-major over (h/kh, w/kw); each token's kh*kw sub-patches are row-major (kh, kw).
    """
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grids:
        seq = x[start:start + t * h * w]
        start += t * h * w
        v = seq.view(t, h // kh, kh, w // kw, kw, -1).mean(dim=0)  # [h/kh, kh, w/kw, kw, D]
        out.append(v.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1))
    return out


class VisionTower(nn.Module):
    """``forward(pixel_values [N, 3, p, p], grid_thws) -> [per image: [h*w/(kh*kw), kh*kw, D]]``."""

    def __init__(self, cfg: VisionConfig, *, backend: str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, device, dtype)
        self.encoder = Encoder(cfg, backend, device, dtype)

    def hidden_states(self, pixel_values: torch.Tensor,
                      grid_thws: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """The final-norm output before merging: [N, D], images packed in order."""
        grids = as_grids(grid_thws, self.cfg)
        check_pixel_values(pixel_values, grids, self.cfg)
        dev = self.patch_embed.proj.weight.device
        if not grids:
            return torch.zeros(0, self.cfg.hidden_size, device=dev, dtype=self.patch_embed.proj.weight.dtype)
        lens = [t * h * w for t, h, w in grids]
        cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device=dev, dtype=torch.int32)  # [n + 1]
        with record_function("vision_patch_embed"):
            x = self.patch_embed(pixel_values.to(dev), grids)  # [N, D]
        rope = rope_2d_angles(grids, self.cfg.head_dim, self.cfg.rope_theta, dev)  # cos, sin [N, Dh/2]
        max_len = max(lens)
        for i, block in enumerate(self.encoder.blocks):
            with record_function(f"vision_block_{i}"):
                x = block(x, rope, cu, max_len)
        return self.encoder.final_layernorm(x)

    def forward(self, pixel_values: torch.Tensor,
                grid_thws: Sequence[Sequence[int]] | torch.Tensor) -> list[torch.Tensor]:
        grids = as_grids(grid_thws, self.cfg)
        return sd2_tpool_merge(self.hidden_states(pixel_values, grids), grids, self.cfg.merge_kernel_size)
