"""Attention Residuals (K3_SPEC §5): the fused ``attn_res_step`` and ``attn_res_mix`` in one Triton kernel.

One program owns ``ROWS`` tokens and the whole hidden row (Hd up to 16384, held in registers), and makes a single
pass over the sources:

    p = partial + delta                        (fp32 add, cast to the activation dtype; a missing term is 0)
    blocks[num_blocks] = p                     (if WRITE_BLOCK)
    for V in [blocks[0], ..., blocks[num_blocks-1], p]:           # online softmax, each source read once
        logit = <norm_w * proj_w, V> * rsqrt(mean(V^2) + eps)
        m' = max(m, logit); acc = acc * exp(m - m') + exp(logit - m') * V; den likewise
    x = (acc / den) cast to the activation dtype                  (what attn_res_mix returns)
    normed = x * rsqrt(mean(x^2) + eps) * rms_w                   (if NORM)

Bytes per token: (num_blocks + #given partial/delta) * Hd reads, plus p, the optional block and the output written.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rocm_k3.ops.attn_res import AttnResStepOutput

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_HD = 16384


@triton.jit
def _attn_res_kernel(
    partial_ptr, delta_ptr, blocks_ptr, proj_ptr, normw_ptr, rmsw_ptr, p_out_ptr, out_ptr,
    n_rows, hd, num_blocks, write_offset, stride_part, stride_delta, stride_bb, stride_bt, stride_p, stride_out, eps,
    HAS_PARTIAL: tl.constexpr, HAS_DELTA: tl.constexpr, WRITE_P: tl.constexpr, WRITE_BLOCK: tl.constexpr,
    NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    cmask = cols < hd
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    c2 = cols[None, :]
    src = blocks_ptr + r64 * stride_bt + c2  # [ROWS, BLOCK_D] pointers into blocks[0]; advanced per source
    left = tl.zeros((ROWS, 1), tl.int32) + num_blocks  # [ROWS, 1] sources still to read from the bank
    if PREFETCH:  # blocks[0] in flight while p is formed: one source ahead of the softmax throughout
        nxt = tl.load(src, mask=mask & (left > 0), other=0.0)
    # p = partial + delta, rounded to the activation dtype.
    if HAS_PARTIAL:
        part = tl.load(partial_ptr + r64 * stride_part + c2, mask=mask, other=0.0)  # [ROWS, BLOCK_D]
        if HAS_DELTA:
            dl = tl.load(delta_ptr + r64 * stride_delta + c2, mask=mask, other=0.0)
            p = (part.to(tl.float32) + dl.to(tl.float32)).to(part.dtype)
        else:
            p = part
    else:
        p = tl.load(delta_ptr + r64 * stride_delta + c2, mask=mask, other=0.0)
    if WRITE_P:
        tl.store(p_out_ptr + r64 * stride_p + c2, p, mask=mask)
    if WRITE_BLOCK:
        tl.store(blocks_ptr + write_offset + r64 * stride_bt + c2, p, mask=mask)  # blocks[num_blocks]
    w = (tl.load(proj_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
         * tl.load(normw_ptr + cols, mask=cmask, other=0.0).to(tl.float32))[None, :]  # [1, BLOCK_D]
    # The partial sum is the last source; start the online softmax with it (its logit is finite).
    pf = p.to(tl.float32)
    m = tl.sum(pf * w, axis=1) / tl.sqrt(tl.sum(pf * pf, axis=1) / hd + eps)  # [ROWS]
    den = tl.full((ROWS,), 1.0, tl.float32)
    acc = pf  # [ROWS, BLOCK_D]
    for i in range(0, num_blocks):
        if PREFETCH:
            v = nxt.to(tl.float32)
            src += stride_bb
            nxt = tl.load(src, mask=mask & (left > i + 1), other=0.0)  # the next source, before the sums
        else:
            v = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            src += stride_bb
        logit = tl.sum(v * w, axis=1) / tl.sqrt(tl.sum(v * v, axis=1) / hd + eps)  # [ROWS]
        m_new = tl.maximum(m, logit)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(logit - m_new)
        acc = acc * alpha[:, None] + v * beta[:, None]
        den = den * alpha + beta
        m = m_new
    x = (acc / den[:, None]).to(p.dtype).to(tl.float32)  # attn_res_mix output, rounded like the reference
    if NORM:
        rw = tl.load(rmsw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / hd + eps)  # [ROWS]
        x = x * inv[:, None] * rw[None, :]
    tl.store(out_ptr + r64 * stride_out + c2, x.to(out_ptr.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Launch shape: ``rows`` tokens per program, ``num_warps``, and whether the next source is prefetched."""

    rows: int
    num_warps: int
    prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("rows", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"AttnResConfig.{name} must be a power of two >= 1, got {value!r}")


def default_config(hd: int) -> AttnResConfig:
    """One row per program for wide rows, several for narrow ones; 4 warps up to 8192 lanes, prefetching.

    H200, Hd 7168 (8192 lanes), 8 blocks + write, T 4096 (benchmarks/RESULTS.md): 4 warps with prefetch 214 us
    (84 % of HBM), 8 warps 249-290 us, 16 warps 299 us with prefetch and 418 us without (the previous default).
    """
    block_d = triton.next_power_of_2(hd)
    rows = max(1, min(16, 1024 // block_d))
    return AttnResConfig(rows, max(4, block_d // 2048))


def _launch(partial, delta, blocks, num_blocks, write_block, write_p, proj_weight, norm_weight, rms_weight,
            p_out, out, eps, norm, config: AttnResConfig | None = None):
    ref = partial if partial is not None else delta
    n_rows, hd = ref.shape
    if n_rows == 0:
        return
    block_d = triton.next_power_of_2(hd)
    cfg = config or default_config(hd)
    rows, num_warps = cfg.rows, cfg.num_warps
    _attn_res_kernel[(triton.cdiv(n_rows, rows),)](
        partial if partial is not None else ref, delta if delta is not None else ref, blocks,
        proj_weight, norm_weight, rms_weight if rms_weight is not None else proj_weight,
        p_out if p_out is not None else out, out,
        n_rows, hd, num_blocks, num_blocks * blocks.stride(0),
        partial.stride(0) if partial is not None else 0, delta.stride(0) if delta is not None else 0,
        blocks.stride(0), blocks.stride(1), p_out.stride(0) if p_out is not None else 0, out.stride(0), float(eps),
        HAS_PARTIAL=partial is not None, HAS_DELTA=delta is not None, WRITE_P=write_p, WRITE_BLOCK=write_block,
        NORM=norm, ROWS=rows, BLOCK_D=block_d, PREFETCH=cfg.prefetch, num_warps=num_warps,
    )


def _last_contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def attn_res_mix(partial: torch.Tensor, blocks: torch.Tensor, num_blocks: int, proj_weight: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``partial [T, Hd]``, ``blocks [B_max, T, Hd]`` -> softmax mix over depth ``[T, Hd]`` (partial dtype)."""
    partial = _last_contig(partial)
    out = torch.empty_like(partial)
    _launch(partial, None, blocks, num_blocks, False, False, proj_weight.contiguous(), norm_weight.contiguous(),
            None, None, out, eps, norm=False)
    return out


def attn_res_step(partial: torch.Tensor | None, delta: torch.Tensor | None, blocks: torch.Tensor, num_blocks: int,
                  *, write_block: bool, proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                  rms_weight: torch.Tensor, eps: float = 1e-5) -> AttnResStepOutput:
    """Fused ``p = partial + delta``, optional ``blocks[num_blocks] = p``, mix, RMSNorm; returns (normed, p)."""
    return attn_res_step_with(partial, delta, blocks, num_blocks, write_block=write_block, proj_weight=proj_weight,
                              norm_weight=norm_weight, rms_weight=rms_weight, eps=eps)


def attn_res_step_with(partial, delta, blocks, num_blocks, *, write_block, proj_weight, norm_weight, rms_weight,
                       eps=1e-5, config: AttnResConfig | None = None) -> AttnResStepOutput:
    """:func:`attn_res_step` with an explicit launch shape (benchmarks, tests)."""
    if config is not None and not isinstance(config, AttnResConfig):
        raise TypeError(f"config must be an AttnResConfig or None, got {type(config).__name__}")
    partial, delta = _last_contig(partial), _last_contig(delta)
    ref = partial if partial is not None else delta
    p_out = torch.empty_like(ref)  # a fresh p even when only one term is given (never an alias of an input)
    out = torch.empty_like(ref)
    _launch(partial, delta, blocks, num_blocks, write_block, True, proj_weight.contiguous(),
            norm_weight.contiguous(), rms_weight.contiguous(), p_out, out, eps, norm=True, config=config)
    return AttnResStepOutput(out, p_out)


def _supports(ref: torch.Tensor, blocks: torch.Tensor) -> tuple[bool, str]:
    if ref.dtype not in _FLOAT_DTYPES:
        return False, f"activations must be bf16/fp16/fp32, got {ref.dtype}"
    if ref.shape[-1] > _MAX_HD:
        return False, f"hidden size {ref.shape[-1]} exceeds the one-tile limit {_MAX_HD}"
    if blocks.stride(-1) != 1:
        return False, "blocks must have a contiguous last dim (the bank is written in place, so no copy is made)"
    return True, "supported"


def attn_res_mix_supports(partial, blocks, num_blocks, proj_weight, norm_weight, eps=1e-5) -> tuple[bool, str]:
    return _supports(partial, blocks)


def attn_res_step_supports(partial, delta, blocks, num_blocks, *, write_block, proj_weight, norm_weight,
                           rms_weight, eps=1e-5) -> tuple[bool, str]:
    return _supports(partial if partial is not None else delta, blocks)


KERNELS = {
    "attn_res_mix": (attn_res_mix, attn_res_mix_supports),
    "attn_res_step": (attn_res_step, attn_res_step_supports),
}
