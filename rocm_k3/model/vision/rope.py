"""The tower's 2-D rotary position embedding (SERVING_SPEC 6.2 step 5).

For head dim Dh there are F = Dh/4 frequencies ``f_i = 1 / theta^(4i / Dh)``. A patch at column x, row y of its
image (0-based, per image) gets the Dh/2 rotation angles interleaved by axis,
``[x f_0, y f_0, x f_1, y f_1, ...]``, and rotation pair p acts on the adjacent elements (2p, 2p+1) of q and k
(GPT-J / non-neox layout)::

    out[2p]     = in[2p] cos(a_p) - in[2p+1] sin(a_p)
    out[2p + 1] = in[2p] sin(a_p) + in[2p+1] cos(a_p)

in fp32, cast back to the input dtype. Positions are row-major over the image's (h, w) patch grid, which is the
order the preprocessor emits patches in; each image starts again at (0, 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rocm_k3.model.vision.config import ROPE_MAX_GRID


def rope_2d_angles(grids: Sequence[tuple[int, int, int]], head_dim: int, theta: float,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 ``[sum(t*h*w), head_dim/2]`` for images with patch grids (t, h, w), packed in order."""
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for the 2-D RoPE, got {head_dim}")
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32) / head_dim)  # [F]
    parts = []
    for t, h, w in grids:
        if not (1 <= h <= ROPE_MAX_GRID and 1 <= w <= ROPE_MAX_GRID):
            raise ValueError(f"image grid {h} x {w} patches exceeds the RoPE table of {ROPE_MAX_GRID} x "
                             f"{ROPE_MAX_GRID}")
        flat = torch.arange(h * w, device=device)
        x = (flat % w).float()  # column
        y = (flat // w).float()  # row
        ang = torch.stack([x[:, None] * freqs, y[:, None] * freqs], dim=-1)  # [h*w, F, 2]: x then y per freq
        parts.append(ang.reshape(h * w, head_dim // 2).repeat(t, 1))
    angles = torch.cat(parts) if parts else torch.empty(0, head_dim // 2, device=device)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x [T, H, Dh]`` by the angles of ``cos, sin [T, Dh/2]`` in fp32; x dtype."""
    t, h, d = x.shape
    pairs = x.float().reshape(t, h, d // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]  # [T, H, Dh/2] each
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack([a * c - b * s, a * s + b * c], dim=-1)  # [T, H, Dh/2, 2]
    return out.reshape(t, h, d).to(x.dtype)
