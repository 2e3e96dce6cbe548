"""Small building blocks of the vision tower: its norms and the bias-optional linear layers.

``VisionNorm`` is LayerNorm (weight + bias, K2.5) or RMSNorm (weight only, K3), both with fp32 math and the
result in the input dtype; RMSNorm goes through ``rocm_k3.ops.rms_norm``. Parameters are named ``weight`` /
``bias`` as the checkpoints name them. ``linear`` builds an ``nn.Linear`` (its forward is ``F.linear``, a plain
GEMM) without spending time on a random initialisation that the checkpoint overwrites.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from rocm_k3 import ops


class VisionNorm(nn.Module):
    """``kind`` "layernorm" or "rmsnorm" over the last dim of width ``dim``.

    eps: a positive float, or None for ``torch.finfo(x.dtype).eps`` of the activation dtype at call time
    (the eps of ``nn.RMSNorm(dim)``, which the K3 tower uses; see :mod:`rocm_k3.model.vision.config`).
    """

    def __init__(self, kind: str, dim: int, eps: float | None, *, backend: str | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"kind: expected 'layernorm' or 'rmsnorm', got {kind!r}")
        self.kind = kind
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if kind == "layernorm" else None

    def resolved_eps(self, dtype: torch.dtype) -> float:
        return float(torch.finfo(dtype).eps) if self.eps is None else float(self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.resolved_eps(x.dtype)
        if self.kind == "rmsnorm":
            return ops.rms_norm(x, self.weight, eps, backend=self.backend)
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.weight.shape[0]}, eps={'finfo(dtype).eps' if self.eps is None else self.eps}"


def linear(in_features: int, out_features: int, bias: bool, device: torch.device | str | None,
           dtype: torch.dtype | None) -> nn.Linear:
    """An ``nn.Linear`` whose parameters are zero-initialised (or left on the meta device): weights come from
    a checkpoint or a seeded generator, never from ``nn.Linear``'s own initialisation."""
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
    if torch.device(device or "cpu").type != "meta":
        layer.to_empty(device=device or "cpu")
        with torch.no_grad():
            for p in layer.parameters():
                p.zero_()
    return layer
