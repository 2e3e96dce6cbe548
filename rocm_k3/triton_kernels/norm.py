"""RMSNorm kernels: ``rms_norm``, ``add_rms_norm`` and ``gated_rms_norm``, one row per tile row.

Math (fp32 inside, output in the activation dtype):
    rms_norm:       y = x * rsqrt(mean(x^2) + eps) * w
    add_rms_norm:   r = (x + residual) cast to x dtype;  y = rms_norm(r)   (the rounded r is normalised)
    gated_rms_norm: y = rms_norm(x) * sigmoid(gate)                         (per head, D = head dim)

All three are one kernel, ``_rms_norm_kernel``, with constexpr switches for the residual add and the gate.
Rows are processed ``ROWS`` at a time in a ``[ROWS, BLOCK_D]`` tile, so short rows (D = 128 heads) still fill a
program. Inputs are viewed as ``[R, D]`` with a row stride; the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK_D = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, gate_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, n_cols, stride_x, stride_res, stride_gate, stride_out, stride_res_out, eps, gate_heads, stride_gate_h,
    HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)  # [ROWS, BLOCK_D]
    if HAS_RES:
        res = tl.load(res_ptr + r64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        summed = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # new residual, rounded like the reference
        tl.store(res_out_ptr + r64[:, None] * stride_res_out + cols[None, :], summed, mask=mask)
        xf = summed.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=1) / n_cols  # [ROWS]
    inv_rms = 1.0 / tl.sqrt(mean_sq + eps)  # [ROWS]
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # [BLOCK_D]
    y = xf * inv_rms[:, None] * w[None, :]
    if HAS_GATE:
        g_row = (r64 // gate_heads) * stride_gate + (r64 % gate_heads) * stride_gate_h  # [ROWS] (token, head)
        g = tl.load(gate_ptr + g_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * tl.sigmoid(g)
    tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t [..., D]`` as ``[R, D]`` with a contiguous last dim (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x2, res2, gate2, weight, out2, res_out2, eps: float,
            gate_heads: tuple[int, int, int] | None = None) -> None:
    """``gate_heads``: (heads, token stride, head stride) of a gate read as [T, H, D] in place (gate row r = token
    r // H, head r % H); None: ``gate2`` is [R, D] with its row stride."""
    n_rows, n_cols = x2.shape
    block_d = triton.next_power_of_2(n_cols)
    rows = max(1, min(64, 2048 // block_d))
    num_warps = 4 if block_d <= 1024 else 8 if block_d <= 4096 else 16
    grid = (triton.cdiv(n_rows, rows),)
    _rms_norm_kernel[grid](
        x2, res2 if res2 is not None else x2, gate2 if gate2 is not None else x2, weight, out2,
        res_out2 if res_out2 is not None else out2,
        n_rows, n_cols, x2.stride(0),
        res2.stride(0) if res2 is not None else 0,
        gate_heads[1] if gate_heads else gate2.stride(0) if gate2 is not None else 0,
        out2.stride(0), res_out2.stride(0) if res_out2 is not None else 0, float(eps),
        gate_heads[0] if gate_heads else 1, gate_heads[2] if gate_heads else 0,
        HAS_RES=res2 is not None, HAS_GATE=gate2 is not None, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x [..., D]`` -> ``[..., D]`` x dtype; see module docstring."""
    x2 = _rows(x)
    out = torch.empty_like(x2)
    if x2.shape[0] > 0:
        _launch(x2, None, None, weight.contiguous(), out, None, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``, both ``[..., D]`` in x dtype."""
    x2, r2 = _rows(x), _rows(residual)
    out, new_res = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0] > 0:
        _launch(x2, r2, None, weight.contiguous(), out, new_res, eps)
    return out.view(x.shape), new_res.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x, gate [T, H, D]``, ``weight [D]`` -> ``RMSNorm_D(x) * weight * sigmoid(gate)`` ``[T, H, D]`` x dtype.
    A gate with contiguous D and any token / head strides (KDA's output gate: a column slice of the in_proj output)
    is read in place, not copied to ``[T H, D]``."""
    x2 = _rows(x)
    heads = None
    if gate.dim() == 3 and gate.stride(-1) == 1:
        g2, heads = gate, (gate.shape[1], gate.stride(0), gate.stride(1))
    else:
        g2 = _rows(gate)
    out = torch.empty_like(x2)
    if x2.shape[0] > 0:
        _launch(x2, None, g2, weight.contiguous(), out, None, eps, heads)
    return out.view(x.shape)


def _supports_rows(*tensors: torch.Tensor) -> tuple[bool, str]:
    for t in tensors:
        if t.dtype not in _FLOAT_DTYPES:
            return False, f"triton norm kernels take bf16/fp16/fp32, got {t.dtype}"
        if t.shape[-1] > _MAX_BLOCK_D:
            return False, f"row length {t.shape[-1]} exceeds the one-tile limit {_MAX_BLOCK_D}"
    return True, "supported"


def rms_norm_supports(x, weight, eps=1e-5) -> tuple[bool, str]:
    return _supports_rows(x)


def add_rms_norm_supports(x, residual, weight, eps=1e-5) -> tuple[bool, str]:
    return _supports_rows(x, residual)


def gated_rms_norm_supports(x, gate, weight, eps=1e-5) -> tuple[bool, str]:
    return _supports_rows(x, gate)


KERNELS = {
    "rms_norm": (rms_norm, rms_norm_supports),
    "add_rms_norm": (add_rms_norm, add_rms_norm_supports),
    "gated_rms_norm": (gated_rms_norm, gated_rms_norm_supports),
}
