"""Triton short convolution of the KDA layer: causal depthwise conv (width W, no bias) + SiLU.

``y[t, c] = act(sum_j weight[c, j] * h[t - (W-1) + j, c])`` where h is the sequence's inputs preceded by its
W-1 history inputs (``conv_state[state_indices[i]]`` [C, W-1], oldest first, when the sequence has initial
state, else zeros). Semantics and signatures are those of :func:`rocm_k3.ops.kda.short_conv` and
:func:`rocm_k3.ops.kda.short_conv_update`.

Prefill runs three launches: the convolution over (token block, channel block) tiles with zeros before each
sequence's first token, then one program per (sequence, channel block) that redoes a sequence's first W-1 rows with
its history when it has one, then one per (sequence, channel block) that writes the new conv state (the last W-1
inputs), so that no program can overwrite a history another program still has to read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.common import plan_chunks

_BC = 128  # channels per program
_BT = 32  # tokens per program
_WARPS = 8  # of the prefill conv: 64 registers at BT 32 x BC 128 on sm_90 (4 warps: 106); not yet timed (RESULTS.md)


@triton.jit
def _silu(y):
    return y / (1.0 + tl.exp(-y))


@triton.jit
def short_conv_kernel(
    x_ptr, w_ptr, y_ptr, chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr, C, stride_x,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
):
    """One (BT-token block, BC-channel block) tile. x rows are ``stride_x`` elements apart (a column slice of a
    wider projection is read in place). Every tap reads x with a plain masked load (row-contiguous, vectorised);
    taps before bos read 0: a sequence with a history gets its first W-1 rows again from
    :func:`conv_history_kernel` (so this kernel holds no history path: with it, the sm_90 build took 255 registers
    and spilled)."""
    ci = tl.program_id(0)
    ic = tl.program_id(1)
    seq = tl.load(chunk_seq_ptr + ci)
    t0 = tl.load(chunk_start_ptr + ci)
    bos = tl.load(cu_seqlens_ptr + seq)
    eos = tl.load(cu_seqlens_ptr + seq + 1)
    rows = t0 + tl.arange(0, BT)  # [BT] global token rows
    cols = ic * BC + tl.arange(0, BC)  # [BC] channels
    mc = cols < C
    mt = rows < eos
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        src = rows - (W - 1) + j  # [BT] input row feeding tap j
        in_seq = (src >= bos) & mt
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                     mask=in_seq[:, None] & mc[None, :], other=0.0).to(tl.float32)  # [BT, BC]
        wj = tl.load(w_ptr + cols * W + j, mask=mc, other=0.0).to(tl.float32)  # [BC]
        acc += xv * wj[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def conv_history_kernel(
    x_ptr, w_ptr, y_ptr, conv_state_ptr, state_indices_ptr, has_init_ptr, cu_seqlens_ptr, C, stride_x,
    W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
):
    """The first W-1 rows of sequence n again, with its history (``conv_state`` [C, W-1], oldest first) for the
    taps before bos, when it has one (else :func:`short_conv_kernel`'s zeros were right: nothing is done). The
    same taps in the same order as that kernel: bit-equal to one pass that reads the history. WP = pow2 >= W-1."""
    n = tl.program_id(0)
    ic = tl.program_id(1)
    if tl.load(has_init_ptr + n) == 0:
        return
    bos = tl.load(cu_seqlens_ptr + n)
    eos = tl.load(cu_seqlens_ptr + n + 1)
    state_row = conv_state_ptr + tl.load(state_indices_ptr + n).to(tl.int64) * C * (W - 1)
    rows = bos + tl.arange(0, WP)  # [WP]
    mt = (rows < eos) & (rows < bos + W - 1)
    cols = ic * BC + tl.arange(0, BC)  # [BC]
    mc = cols < C
    acc = tl.zeros([WP, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        src = rows - (W - 1) + j  # [WP]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                     mask=((src >= bos) & mt)[:, None] & mc[None, :], other=0.0)
        hv = tl.load(state_row + cols[None, :] * (W - 1) + (src - bos + (W - 1))[:, None],
                     mask=((src < bos) & mt)[:, None] & mc[None, :], other=0.0)
        wj = tl.load(w_ptr + cols * W + j, mask=mc, other=0.0).to(tl.float32)  # [BC]
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * wj[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def conv_state_kernel(
    x_ptr, conv_state_ptr, state_indices_ptr, has_init_ptr, cu_seqlens_ptr, C, stride_x,
    W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
):
    """conv_state[slot] <- the last W-1 entries of (history, inputs) of one sequence (WP = pow2 >= W-1)."""
    n = tl.program_id(0)
    ic = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + n)
    eos = tl.load(cu_seqlens_ptr + n + 1)
    hist_lo = tl.where(tl.load(has_init_ptr + n) != 0, bos - (W - 1), bos)  # rows before bos kept from history
    state_row = conv_state_ptr + tl.load(state_indices_ptr + n).to(tl.int64) * C * (W - 1)
    cols = ic * BC + tl.arange(0, BC)
    jj = tl.arange(0, WP)
    mc = cols < C
    mj = jj < W - 1
    pos = eos - (W - 1) + jj  # [WP] source token of new history entry j
    in_seq = pos >= bos
    m = mc[:, None] & mj[None, :]
    xv = tl.load(x_ptr + pos.to(tl.int64)[None, :] * stride_x + cols[:, None], mask=m & in_seq[None, :], other=0.0)
    hist = pos - bos + (W - 1)
    mh = m & ((pos < bos) & (pos >= hist_lo))[None, :]
    hv = tl.load(state_row + cols[:, None] * (W - 1) + hist[None, :], mask=mh, other=0.0)
    new = tl.where(in_seq[None, :], xv.to(tl.float32), hv.to(tl.float32))  # [BC, WP]
    tl.debug_barrier()  # replicated lanes: every old history entry is read before any is overwritten
    tl.store(state_row + cols[:, None] * (W - 1) + jj[None, :], new.to(conv_state_ptr.dtype.element_ty), mask=m)


@triton.jit
def short_conv_update_kernel(
    x_ptr, w_ptr, y_ptr, conv_state_ptr, state_indices_ptr, C,
    W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
):
    """One decode token per sequence n: y = act(w . [history, x]); history <- [history[1:], x]."""
    n = tl.program_id(0)
    ic = tl.program_id(1)
    cols = ic * BC + tl.arange(0, BC)
    jj = tl.arange(0, WP)
    mc = cols < C
    m = mc[:, None] & (jj < W - 1)[None, :]
    hist = conv_state_ptr + tl.load(state_indices_ptr + n).to(tl.int64) * C * (W - 1) \
        + cols[:, None] * (W - 1) + jj[None, :]  # [BC, WP]
    hv = tl.load(hist, mask=m, other=0.0)
    wt = tl.load(w_ptr + cols[:, None] * W + jj[None, :], mask=m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + n.to(tl.int64) * C + cols, mask=mc, other=0.0)
    w_last = tl.load(w_ptr + cols * W + (W - 1), mask=mc, other=0.0).to(tl.float32)
    acc = tl.sum(hv.to(tl.float32) * wt, axis=1) + w_last * x.to(tl.float32)
    shifted = tl.load(hist + 1, mask=mc[:, None] & (jj + 1 < W - 1)[None, :], other=0.0)
    new = tl.where((jj == W - 2)[None, :], x[:, None].to(hv.dtype), shifted)
    tl.debug_barrier()  # replicated lanes: every history entry is read before any is overwritten
    tl.store(hist, new, mask=m)
    if SILU:
        acc = _silu(acc)
    tl.store(y_ptr + n.to(tl.int64) * C + cols, acc.to(y_ptr.dtype.element_ty), mask=mc)


def _check_activation(activation: str | None) -> tuple[bool, str]:
    if activation not in ("silu", None):
        return False, f"triton short_conv supports activation 'silu' or None, got {activation!r}"
    return True, "supported"


def supports_short_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, *,
                        conv_state: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                        has_initial_state: torch.Tensor | None = None,
                        activation: str | None = "silu") -> tuple[bool, str]:
    """(ok, reason): width >= 2, contiguous conv state (updated in place), silu or no activation."""
    if weight.shape[1] < 2:
        return False, f"triton short_conv needs a kernel width >= 2, got {weight.shape[1]}"
    if conv_state is not None and not conv_state.is_contiguous():
        return False, "triton short_conv updates conv_state in place: it must be contiguous"
    return _check_activation(activation)


def short_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, *,
               conv_state: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
               has_initial_state: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """Varlen causal depthwise conv + activation: x [T, C], weight [C, W], cu_seqlens int32 [N+1] -> y [T, C]
    (x dtype); conv_state [S, C, W-1] updated in place at state_indices when given. x may be a column slice of a
    wider tensor (rows any stride, channels contiguous): it is read in place."""
    T, C = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1
    x = x if x.stride(1) == 1 or C == 1 else x.contiguous()
    weight = weight.contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    has_state = conv_state is not None
    if has_state:
        idx = state_indices.to(torch.int32).contiguous()
        if has_initial_state is None:
            has_init = torch.zeros(N, dtype=torch.int8, device=x.device)
        else:
            has_init = has_initial_state.to(torch.int8).contiguous()
    else:
        idx, has_init = cu, cu  # unread placeholders
    plan = plan_chunks(cu, T, _BT)
    silu = activation == "silu"
    if plan.num_chunks > 0:
        short_conv_kernel[(plan.num_chunks, triton.cdiv(C, _BC))](
            x, weight, y, plan.chunk_seq, plan.chunk_start, cu, C, x.stride(0), W=W, BT=_BT, BC=_BC, SILU=silu,
            num_warps=_WARPS,
        )
    wp = triton.next_power_of_2(W - 1)
    if has_state and N > 0:  # before conv_state_kernel overwrites the histories it reads (stream order)
        conv_history_kernel[(N, triton.cdiv(C, _BC))](
            x, weight, y, conv_state, idx, has_init, cu, C, x.stride(0), W=W, WP=wp, BC=_BC, SILU=silu, num_warps=4,
        )
        conv_state_kernel[(N, triton.cdiv(C, _BC))](
            x, conv_state, idx, has_init, cu, C, x.stride(0), W=W, WP=wp, BC=_BC, num_warps=4,
        )
    return y


def supports_short_conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                               state_indices: torch.Tensor, activation: str | None = "silu") -> tuple[bool, str]:
    """(ok, reason): width >= 2, contiguous conv state, silu or no activation."""
    if weight.shape[1] < 2:
        return False, f"triton short_conv_update needs a kernel width >= 2, got {weight.shape[1]}"
    if not conv_state.is_contiguous():
        return False, "triton short_conv_update updates conv_state in place: it must be contiguous"
    return _check_activation(activation)


def short_conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                      activation: str | None = "silu") -> torch.Tensor:
    """One decode token per sequence: x [N, C], weight [C, W], conv_state [S, C, W-1] (shifted in place)
    -> y [N, C] in x's dtype."""
    N, C = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    if N == 0:
        return y
    short_conv_update_kernel[(N, triton.cdiv(C, _BC))](
        x.contiguous(), weight.contiguous(), y, conv_state, state_indices.to(torch.int32).contiguous(), C,
        W=W, WP=triton.next_power_of_2(W - 1), BC=_BC, SILU=activation == "silu", num_warps=4,
    )
    return y
