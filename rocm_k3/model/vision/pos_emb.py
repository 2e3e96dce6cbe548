"""The learnable 2-D position table, resampled to each image's patch grid (SERVING_SPEC 6.2 step 3).

``weight [H0, W0, D]`` (checkpoint ``vision_tower.patch_embed.pos_emb.weight``, 64 x 64 in both releases) is
resampled per image to its (h, w) patch grid with ``F.interpolate`` (``align_corners=False``): bilinear in K3,
bicubic in K2.5 (PyTorch's bicubic, a = -0.75, border-clamped taps). A grid equal to the table's is used as is.
The math is fp32; rows come out row-major over (h, w), the preprocessor's patch order.

The released ``divided_fixed`` table also adds a fixed sincos time embedding for video frames (t > 1); rocm-k3
serves images only (t = 1, no time term), so that table is not built and t > 1 is refused by the tower.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


class PositionTable(nn.Module):
    """``forward(grids) -> fp32 [sum(h*w), D]``: the table resampled to each (t=1, h, w) grid, packed in order."""

    def __init__(self, height: int, width: int, dim: int, mode: str, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if mode not in ("bilinear", "bicubic"):
            raise ValueError(f"mode: expected 'bilinear' or 'bicubic', got {mode!r}")
        self.mode = mode
        self.weight = nn.Parameter(torch.zeros(height, width, dim, device=device, dtype=dtype))

    def resampled(self, h: int, w: int) -> torch.Tensor:
        """The table at an (h, w) grid: fp32 [h*w, D]."""
        table = self.weight.float()  # [H0, W0, D]
        if (h, w) == tuple(table.shape[:2]):
            return table.reshape(h * w, -1)
        grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=self.mode, align_corners=False)
        return grid[0].permute(1, 2, 0).reshape(h * w, -1)  # [1, D, h, w] -> [h*w, D]

    def forward(self, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        parts = [self.resampled(h, w) for _, h, w in grids]
        return torch.cat(parts) if parts else self.weight.new_zeros(0, self.weight.shape[-1], dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, mode={self.mode}"
