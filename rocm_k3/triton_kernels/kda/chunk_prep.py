"""Phase 1 of the chunked KDA prefill: per-token preparation, one program per (chunk, head) or, with
``COL_SPLIT`` (``prefill.PREP_SPLIT``), per (chunk, BK-column slice, head).

For the rows of one 64-token chunk of one head:
    g  = kda_gate(f)            when the gate is fused (else g is the given fp32 log-decay)
    G  = cumsum(g) over the chunk's tokens                          fp32 [T, H, K]
    q' = scale * q / sqrt(sum q^2 + 1e-6),  k' = k / sqrt(...)      (when qk_l2norm; else q' = scale * q, k' = k)
    b  = sigmoid(beta)                                              (when beta_logits; else beta as is), fp32 [T, H]
    QG = q' * exp(G),  KD = k' * exp(G_last - G),  GL = exp(G_last)  (G_last: G at the chunk's last token)
q', k', QG and KD are written in the activation dtype; GL fp32 [NC, H, K]. With ``GATE_ONLY``
(``prefill.NORMS_IN_INTRA``, the default) q and k are not read at all and q', k', QG, KD not written: only G, GL and
b (chunk_intra then normalises the raw q, k itself and writes QG and KD). q and k may be strided views (any token-row
stride, head stride K, element stride 1: column slices of the short conv's [T, 3HK] output); g, beta and every output
are contiguous. With ``FACTORS`` (``prefill.GATE_FACTORS``, with GATE_ONLY) the prep writes, instead of G, the sub-block
decay factors E = exp(G - G_m) in gcum_ptr's dtype (bf16 for bf16 activations: half of fp32 G's bytes), G_m being
the midpoint of each 16-row sub-block's G range (G before its first row plus half its sum: no row to pick out), and
G_m of the four sub-blocks plus G_last to gref_ptr, fp32 [NC, H, 5, K]; |G - G_m| stays within 8 steps of decay
(exp(+-40) under K3's safe gate).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.kda.common import exp_f32, gate, grid_ids, sigmoid_f32


@triton.jit
def chunk_prep_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr,  # q, k [T, H, K] (row strides below); g [T, H, K] (log-decay or raw f); beta [T, H]
    a_log_ptr, dt_bias_ptr,  # gate parameters: fp32 [H], fp32 [H*K] (read only when HAS_GATE)
    chunk_seq_ptr, chunk_start_ptr, cu_seqlens_ptr,  # chunk plan (int32)
    qn_ptr, kn_ptr, gcum_ptr, beta_out_ptr,  # outputs: q', k' [T, H, K]; G fp32 [T, H, K] (FACTORS: E in the
    # buffer's dtype, bf16 for bf16 activations); b fp32 [T, H]
    qg_ptr, kd_ptr, glast_ptr,  # outputs: QG, KD [T, H, K]; GL fp32 [NC, H, K]
    gref_ptr,  # output with FACTORS: G_m (each sub-block's G-range midpoint) of the four and G_last, fp32 [NC, H, 5, K]
    scale, lower_bound,  # fp32 scalars
    stride_q, stride_k,  # token-row strides of q and k in elements (head stride K, element stride 1)
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_GATE: tl.constexpr, SAFE_GATE: tl.constexpr, QK_NORM: tl.constexpr, BETA_LOGITS: tl.constexpr,
    COL_SPLIT: tl.constexpr, GATE_ONLY: tl.constexpr = False, FAST_EXP: tl.constexpr = False,
    FACTORS: tl.constexpr = False,
):
    """Works on [BT, BK] column slices (BK divides K): the squared norms first (over all K columns), then
    everything else. Grid (NC, H): one program per (chunk, head) walks the K / BK slices; with COL_SPLIT, grid
    (NC * K / BK, H): one program per (chunk, slice, head) does one slice (a chunk-head's slices run side by side,
    so their repeated norm reads of q and k hit L2), and the slice-0 program writes b."""
    tl.static_assert(not FACTORS or GATE_ONLY, "FACTORS writes E instead of G: the q', k' path needs G")
    n_slices: tl.constexpr = 1 if COL_SPLIT else K // BK
    c, h, j0 = grid_ids(K // BK // n_slices)  # grid (NC * K / BK, H), or (NC, H) without COL_SPLIT
    seq = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    eos = tl.load(cu_seqlens_ptr + seq + 1)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BK)
    mask_t = (t0 + rows) < eos  # [BT]
    mask = mask_t[:, None]
    r64 = (t0 + rows).to(tl.int64)[:, None]
    base = r64 * (H * K) + h * K + cols[None, :]  # [BT, BK], slice 0 of the outputs
    q_base = r64 * stride_q + h * K + cols[None, :]  # ... and of the (possibly strided) inputs
    k_base = r64 * stride_k + h * K + cols[None, :]

    q_scale = tl.full([BT], 1.0, tl.float32) * scale  # per-row factor of q: scale (/ ||q||)
    k_scale = tl.full([BT], 1.0, tl.float32)
    if QK_NORM and not GATE_ONLY:
        q_sq = tl.zeros([BT], dtype=tl.float32)
        k_sq = tl.zeros([BT], dtype=tl.float32)
        for j in range(0, K // BK):
            qs = tl.load(q_ptr + q_base + j * BK, mask=mask, other=0.0).to(tl.float32)
            ks = tl.load(k_ptr + k_base + j * BK, mask=mask, other=0.0).to(tl.float32)
            q_sq += tl.sum(qs * qs, axis=1)
            k_sq += tl.sum(ks * ks, axis=1)
        q_scale = scale / tl.sqrt(q_sq + 1e-6)
        k_scale = 1.0 / tl.sqrt(k_sq + 1e-6)

    for jj in range(0, n_slices):
        j = j0 + jj
        offs = base + j * BK
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BT, BK]
        if HAS_GATE:
            a_log = tl.load(a_log_ptr + h)
            dt_bias = tl.load(dt_bias_ptr + h * K + j * BK + cols)  # [BK]
            g = gate(g, a_log, dt_bias[None, :], lower_bound, SAFE_GATE, FAST_EXP)
        g = tl.where(mask, g, 0.0)
        if FACTORS:  # per 16-row sub-block: E = exp(G - G_m), G_m the midpoint of the sub-block's G range
            g3 = tl.reshape(g, [BT // 16, 16, BK])
            tot = tl.sum(g3, axis=1)  # [4, BK] each sub-block's sum (padding rows add 0)
            e = exp_f32(tl.cumsum(g3, axis=1) - 0.5 * tot[:, None, :], FAST_EXP)  # |exponent| <= 8 steps of decay
            tl.store(gcum_ptr + offs, tl.reshape(e, [BT, BK]).to(gcum_ptr.dtype.element_ty), mask=mask)
            ref_row = (c * H + h).to(tl.int64) * 5
            gm = tl.cumsum(tot, axis=0) - 0.5 * tot  # [4, BK] G_m, from the chunk's start
            tl.store(gref_ptr + (ref_row + tl.arange(0, BT // 16))[:, None] * K + j * BK + cols[None, :], gm)
            glast = tl.sum(tot, axis=0)  # [BK]
            tl.store(gref_ptr + (ref_row + 4) * K + j * BK + cols, glast)
        else:
            gc = tl.cumsum(g, axis=0)  # [BT, BK]
            tl.store(gcum_ptr + offs, gc, mask=mask)
            glast = tl.sum(g, axis=0)  # [BK] G at the last token (padding rows add 0)
        tl.store(glast_ptr + (c * H + h).to(tl.int64) * K + j * BK + cols, exp_f32(glast, FAST_EXP))
        if not GATE_ONLY:
            q = tl.load(q_ptr + q_base + j * BK, mask=mask, other=0.0).to(tl.float32) * q_scale[:, None]
            k = tl.load(k_ptr + k_base + j * BK, mask=mask, other=0.0).to(tl.float32) * k_scale[:, None]
            tl.store(qn_ptr + offs, q.to(qn_ptr.dtype.element_ty), mask=mask)
            tl.store(kn_ptr + offs, k.to(kn_ptr.dtype.element_ty), mask=mask)
            tl.store(qg_ptr + offs, (q * exp_f32(gc, FAST_EXP)).to(qg_ptr.dtype.element_ty), mask=mask)
            kdecay = exp_f32(tl.where(mask, glast[None, :] - gc, 0.0), FAST_EXP)  # <= 1
            tl.store(kd_ptr + offs, (k * kdecay).to(kd_ptr.dtype.element_ty), mask=mask)

    if j0 == 0:
        b_offs = (t0 + rows).to(tl.int64) * H + h
        b = tl.load(beta_ptr + b_offs, mask=mask_t, other=0.0).to(tl.float32)  # [BT]
        if BETA_LOGITS:
            b = sigmoid_f32(b, FAST_EXP)
        tl.store(beta_out_ptr + b_offs, b, mask=mask_t)
