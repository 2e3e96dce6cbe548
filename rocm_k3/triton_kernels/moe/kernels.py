"""The MoE kernels: the expert GEMM (w13 + activation, w2 + routing weight), the MXFP8 round trip, the top-k reduce.

``moe_gemm_kernel`` is one persistent kernel for both GEMMs. Its work items are (expert block, 128-row tile
[, K split]) over the *used* blocks only: the block count comes from the device (written by the align kernel), so
the launch needs no host sync and is CUDA-graph safe; the grid is a few programs per SM, each looping over items
(round-robin, or DYNAMIC: claimed from an atomic counter the align zeroed).
A tile is two 64-row groups; swap-AB: ``acc [128 weight rows, BMT rows of the block] += W [128, BK] @ a[BMT, BK]^T``
with the decoded weights as the wide MMA operand (wgmma on sm_90, MFMA on AMD) and the block's rows (tokens at
decode: 16) as the narrow one. Loads of the weight chunks, scales and activations feed the dot and are software
pipelined by Triton (``num_stages``: cp.async into shared memory on NVIDIA).

- STAGE 1 (w13): rows 0..63 of a tile are gate rows, 64..127 the matching up rows (layout interleave), so the
  epilogue computes ``act(gate, up)`` for 64 outputs and writes ``inter[block row, n]`` (bf16, or fp32 with
  OP_F32); OUT_MX (A8W4) rounds it through MXFP8 first (exact round trip of the reference's quantisation).
  FAST_ACT (NVIDIA, every decode and operand path): the activation's sigmoids on the MUFU ex2 / rcp approximations
  and ``x / beta`` as ``x * (1 / beta)``, a few fp32 ulp from the portable math (``pointwise.sigmoid_f32``).
- STAGE 2 (w2): ``y[split, pair, n] = topk_weight[pair] * acc`` for the pairs of the block; K can be split
  (``SPLIT``, ``MoEConfig.split_k``; the default tiles do not split), the splits are summed in the reduce.

Weights: W_FMT 0 is the MXFP4 ``triton`` layout decoded by :func:`.decode.weight_tile` (DECODE: inline PTX on
NVIDIA, portable Triton elsewhere); W_FMT 1 is bf16 experts in checkpoint layout (gate rows n, up rows N + n).

Operand precision: bf16 activations and weights on the MMA, fp32 accumulation. OP_F32 (fp32 x, A16W4 or bf16
experts): x, the decoded weights and the intermediate stay fp32 and the dots are IEEE fp32 (``input_precision
="ieee"``), so an fp32 model matches the fp32 reference up to summation order (and, on NVIDIA, FAST_ACT's few
ulp in the activation). DOT_F32 (the interpreter, whose bf16 ``tl.dot`` is wrong): the same bf16 values,
multiplied as fp32.

``topk_reduce_kernel``: ``out[t] = sum_{s, j} y[s, t * top_k + j]`` in a fixed order (deterministic).
``mxfp8_round_trip_kernel``: ``x -> dequant(quant_MXFP8(x))`` with the compressed-tensors rule, exact in bf16.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from rocm_k3.triton_kernels.moe.decode import weight_tile
from rocm_k3.triton_kernels.moe.mx import mxfp8_value
from rocm_k3.triton_kernels.moe.pointwise import sigmoid_f32, tanh_f32

ACT_SITU = 0
ACT_SILU = 1
W_MXFP4 = 0
W_BF16 = 1
# moe_gemm_kernel's runtime arguments as a bf16-activation MXFP4 w13 launch passes them (Triton type strings), and
# those a launch at K3 sizes specialises as divisible by 16; for cross-compiling it (compile tier, SASS counts)
GEMM_SIGNATURE = {
    "a_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16", "topw_ptr": "*fp32", "sorted_ptr": "*i32",
    "block_expert_ptr": "*i32", "start_ptr": "*i32", "count_ptr": "*i32", "nblk_ptr": "*i32", "work_ptr": "*i32",
    "K": "i32", "N_OUT": "i32", "top_k": "i32", "n_tiles": "i32", "steps_per_split": "i32", "stride_a": "i32",
    "stride_we": "i64", "stride_wg": "i32", "stride_wse": "i64", "stride_wsg": "i32", "stride_wn": "i32",
    "stride_out": "i32", "stride_split": "i32", "beta": "fp32", "linear_beta": "fp32"}
GEMM_DIVISIBLE = ("a_ptr", "w_ptr", "ws_ptr", "out_ptr", "topw_ptr", "sorted_ptr", "block_expert_ptr", "start_ptr",
                  "count_ptr", "nblk_ptr", "work_ptr", "K", "N_OUT", "top_k", "stride_a", "stride_we", "stride_wg",
                  "stride_wse", "stride_wsg", "stride_wn", "stride_out", "stride_split")


@triton.jit
def mx_round_trip(v, R: tl.constexpr, C: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr,
                   FP8_MAX: tl.constexpr):
    """fp32 [R, C] -> fp32 [R, C]: quantised to MXFP8 per 32 along C (ct rule) and decoded back (exact)."""
    g = tl.reshape(v, (R, C // 32, 32))  # [R, G, 32]
    back = mxfp8_value(g, tl.max(tl.abs(g), axis=2)[:, :, None], EMAX, BIAS, FP8_MAX)
    return tl.reshape(back, (R, C))


@triton.jit
def mxfp8_round_trip_kernel(x_ptr, out_ptr, n_rows, K, stride_x, stride_out, EMAX: tl.constexpr,
                            BIAS: tl.constexpr, FP8_MAX: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [R, K] = the MXFP8 (E4M3 with bias BIAS, E8M0 per 32) value of x [R, K], in out's dtype (exact)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < n_rows)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = mx_round_trip(x, ROWS, BLOCK_K, EMAX, BIAS, FP8_MAX)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bf16_tile(w_ptr, row_off, rmask, k0, K, BK: tl.constexpr):
    """bf16 experts: rows ``row_off`` [128] (element offsets), K columns k0 .. k0 + BK -> [128, BK] (masked)."""
    kk = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + row_off[:, None] + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def gate_up_activation(gate, up, beta, linear_beta, ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                FAST: tl.constexpr):
    """SiTU ``beta tanh(g/beta) sigmoid(g) * (lb tanh(u/lb) | u)`` or SiLU ``silu(g) * u`` (fp32). FAST (NVIDIA):
    the sigmoids on the MUFU approximations and ``x / beta`` as ``x * (1 / beta)`` (a few ulp in fp32)."""
    if FAST:
        gate_in = gate * (1.0 / beta)
        up_in = up * (1.0 / linear_beta)
    else:
        gate_in = gate / beta
        up_in = up / linear_beta
    if ACT == 0:
        g = beta * tanh_f32(gate_in, FAST) * sigmoid_f32(gate, FAST)
        if HAS_LINEAR_BETA:
            u = linear_beta * tanh_f32(up_in, FAST)
        else:
            u = up
    else:
        g = gate * sigmoid_f32(gate, FAST)
        u = up
    return g * u


@triton.jit
def moe_gemm_kernel(
        a_ptr, w_ptr, ws_ptr, out_ptr, topw_ptr,
        sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr, work_ptr,
        K, N_OUT, top_k, n_tiles, steps_per_split,
        stride_a, stride_we, stride_wg, stride_wse, stride_wsg, stride_wn, stride_out, stride_split,
        beta, linear_beta,
        STAGE: tl.constexpr, W_FMT: tl.constexpr, DECODE: tl.constexpr, FOLD: tl.constexpr,
        OP_F32: tl.constexpr, DOT_F32: tl.constexpr, ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
        OUT_MX: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
        EVEN_K: tl.constexpr, SPLIT: tl.constexpr, BMT: tl.constexpr, KU: tl.constexpr, STAGES: tl.constexpr,
        DYNAMIC: tl.constexpr, FAST_ACT: tl.constexpr):
    """Persistent expert GEMM over the used (block, tile, split) items; see the module docstring.

    a: STAGE 1 x [T, K] (bf16, fp32 with OP_F32), STAGE 2 inter [P_max, N]; out: STAGE 1 inter [P_max, N_OUT],
    STAGE 2 y fp32 [SPLIT, T * top_k, N_OUT]. MXFP4 w / ws: layout codes / scales of the matrix (expert stride
    stride_we / stride_wse, row-group stride stride_wg / stride_wsg); bf16 w: [E, rows, K] (stride_we, stride_wn).
    K: reduction length of the activations (the weights are padded past it); EVEN_K: K % BK == 0 (no K mask on
    the activation loads). BK = 64 * KU. Items: program p takes p, p + programs, ... or, DYNAMIC, the next
    unclaimed one from the counter ``work_ptr`` (int32, zero at launch; claimed one item ahead, so its latency
    hides behind the current item).
    """
    BK: tl.constexpr = 64 * KU
    n_items = tl.load(nblk_ptr) * n_tiles * SPLIT
    r128 = tl.arange(0, 128)
    t_idx = tl.arange(0, BMT)
    if DYNAMIC:
        item = tl.atomic_add(work_ptr, 1)
    else:
        item = tl.program_id(0)
    while item < n_items:
        if DYNAMIC:
            next_item = tl.atomic_add(work_ptr, 1)
        else:
            next_item = item + tl.num_programs(0)
        split = item % SPLIT
        tile = (item // SPLIT) % n_tiles
        blk = item // (SPLIT * n_tiles)
        expert = tl.load(block_expert_ptr + blk)
        row_end = tl.load(start_ptr + expert) + tl.load(count_ptr + expert)
        rows = blk * BMT + t_idx  # [BMT] padded-layout rows of the block
        rmask = rows < row_end
        pair = tl.load(sorted_ptr + rows, mask=rmask, other=0)
        if STAGE == 1:
            a_off = (pair // top_k).to(tl.int64) * stride_a  # token rows of x
        else:
            a_off = rows.to(tl.int64) * stride_a  # the block's own rows of inter
        e64 = expert.to(tl.int64)
        if W_FMT == 0:
            w_base = w_ptr + e64 * stride_we + (2 * tile) * stride_wg.to(tl.int64)
            s_base = ws_ptr + e64 * stride_wse + (2 * tile) * stride_wsg.to(tl.int64)
        else:
            if STAGE == 1:  # gate rows 64 tile + r, then up rows N + 64 tile + r
                wrow = tile * 64 + (r128 % 64) + (r128 // 64) * N_OUT
                wrmask = tile * 64 + (r128 % 64) < N_OUT
            else:
                wrow = tile * 128 + r128
                wrmask = wrow < N_OUT
            w_rows = e64 * stride_we + wrow.to(tl.int64) * stride_wn
        k_begin = split * steps_per_split * BK
        k_end = tl.minimum(k_begin + steps_per_split * BK, K)
        acc = tl.zeros((128, BMT), tl.float32)
        for k0 in tl.range(k_begin, k_end, BK, num_stages=STAGES):
            kk = k0 + tl.arange(0, BK)
            if EVEN_K:
                a = tl.load(a_ptr + a_off[:, None] + kk[None, :], mask=rmask[:, None], other=0.0)
            else:
                a = tl.load(a_ptr + a_off[:, None] + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :],
                            other=0.0)
            if W_FMT == 0:
                w = weight_tile(w_base + (k0 // 128) * 4096, s_base + (k0 // 128) * 256, stride_wg, stride_wsg,
                                DECODE, FOLD, OP_F32 or DOT_F32, KU)
            else:
                w = _bf16_tile(w_ptr, w_rows, wrmask, k0, K, BK)
            if OP_F32:
                acc = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
            elif DOT_F32:  # interpreter: its bf16 tl.dot is wrong; the same bf16 values as fp32
                acc = tl.dot(w.to(tl.bfloat16).to(tl.float32), tl.trans(a.to(tl.bfloat16).to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(w.to(tl.bfloat16), tl.trans(a.to(tl.bfloat16)), acc)
        if STAGE == 1:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, 64, BMT)), (1, 2, 0)))  # [64, BMT] each
            h = gate_up_activation(gate, up, beta, linear_beta, ACT, HAS_LINEAR_BETA, FAST_ACT)
            n = tile * 64 + tl.arange(0, 64)
            ht = tl.trans(h)  # [BMT, 64]
            if OUT_MX:
                ht = mx_round_trip(ht, BMT, 64, EMAX, BIAS, FP8_MAX)
            optr = out_ptr + rows.to(tl.int64)[:, None] * stride_out + n[None, :]
            tl.store(optr, ht.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (n < N_OUT)[None, :])
        else:
            rw = tl.load(topw_ptr + pair, mask=rmask, other=0.0)  # [BMT] routing weights
            n = tile * 128 + r128
            yt = tl.trans(acc) * rw[:, None]  # [BMT, 128]
            optr = out_ptr + split * stride_split + pair.to(tl.int64)[:, None] * stride_out + n[None, :]
            tl.store(optr, yt, mask=rmask[:, None] & (n < N_OUT)[None, :])
        item = next_item


@triton.jit
def topk_reduce_kernel(y_ptr, out_ptr, Kout, stride_y, stride_split, stride_out, TOP_K: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum_{s, j} y[s, t * TOP_K + j] (fp32, fixed order: deterministic), cast to the output dtype. PDL
    (NVIDIA, launched with ``launch_pdl``): the programs start while the w2 GEMM finishes and wait for it here."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < Kout
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):  # unrolled: all loads in flight at once
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + s * stride_split + (t * TOP_K + j) * stride_y + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
