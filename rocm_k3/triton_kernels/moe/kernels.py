"""The MoE kernels: MXFP8 activation pre-pass, w13 GEMM + activation, w2 GEMM + routing weight, top-k reduce.

Rows of both GEMMs follow the padded expert-sorted layout of :mod:`.align` (block b = BM rows of one expert).
MXFP4 weights are consumed by ``tl.dot_scaled(a_bf16, None, "bf16", w_e2m1, w_scale, "e2m1")``: Triton decodes
E2M1 x E8M0 in registers on sm_90 / gfx942 (then wgmma / v_mfma on bf16) and gfx950 has a scaled MFMA.
``W_FMT == 2`` decodes the nibbles by hand (``mx.e2m1_decode``) and uses ``tl.dot``: a fallback and a
cross-check of ``dot_scaled``. ``W_FMT == 3`` ("bits") places each nibble's 3 magnitude bits straight into an
fp32 bit pattern (an fp32 subnormal/normal equal to E2M1 * 2^-126, see ``_e2m1_bits_tile``) and multiplies by
the E8M0 scale, and splits the activations into even and odd K columns instead of interleaving the decoded
nibbles. bf16 experts (``W_FMT == 1``) use a plain ``tl.dot``.

The decode GEMVs use no MMA: ``W_FMT == 4`` ("fma", any BM) decodes [BN, G, 16] byte tiles and multiplies the
even / odd activation columns on fp32 FMAs; ``W_FMT == 5`` ("gemv", BM = 1, the default at decode) reads the
weights as int32 words and keeps weights, scales and activations in one register layout (no shared-memory
layout conversion in the K loop, 6-7 SASS instructions per weight element vs ~14), double-buffers the weight
loads, and with ``F16_DECODE`` decodes two codes per shift/mask pair (``_gemv_words``).

Operand precision (``OP_F32``): with bf16/fp16 activations the MMA operands are bf16 (the fast path). With fp32
activations (A16W4 or bf16 experts; not A8W4, whose MXFP8 operands are exact in bf16 anyway) the launcher sets
``OP_F32``: x and the intermediate activation stay fp32, the weights are decoded to fp32 (E2M1 x E8M0 and bf16
values are exact in fp32) and every ``tl.dot`` runs with ``input_precision="ieee"`` (no TF32), so both GEMMs
compute what the fp32 reference computes up to summation order. ``dot_scaled`` has no fp32-operand form, so the
launcher maps ``W_FMT == 0`` to the manual decode in that mode.

A8W4 activations are stored as E4M3 code bytes (uint8) + E8M0 bytes and decoded in registers with
``mx.fp8_e4m3_decode`` (exact), so OCP (bias 7) and FNUZ (bias 8) share one code path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.moe.mx import (
    e2m1_decode,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    mx_scale_exponent,
    pow2,
)
from rocm_k3.triton_kernels.moe.pointwise import tanh_f32

ACT_SITU = 0
ACT_SILU = 1
W_MXFP4 = 0
W_BF16 = 1
W_MXFP4_MANUAL = 2
W_MXFP4_BITS = 3
W_MXFP4_FMA = 4  # MXFP4 decoded to fp32 in registers, multiply-add on the CUDA/vector cores (no MMA): decode GEMV
W_MXFP4_GEMV = 5  # the same on 32-bit weight words with every tile in one register layout (BM = 1 only)


@triton.jit
def _mx_quantize_tile(v, R: tl.constexpr, C: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr,
                      FP8_MAX: tl.constexpr):
    """fp32 [R, C] -> (E4M3 codes int32 [R, C], scale bytes int32 [R, C // 32]) with the ct rule."""
    g = tl.reshape(v, (R, C // 32, 32))  # [R, G, 32]
    e = mx_scale_exponent(tl.max(tl.abs(g), axis=2), EMAX)  # [R, G]
    scaled = g * pow2(-e)[:, :, None]
    scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
    codes = fp8_e4m3_encode(scaled, BIAS)  # [R, G, 32]
    return tl.reshape(codes, (R, C)), e + 127


@triton.jit
def _mx_dequantize_tile(codes, scales, R: tl.constexpr, C: tl.constexpr, BIAS: tl.constexpr):
    """E4M3 codes int32 [R, C] and scale bytes int32 [R, C // 32] -> fp32 [R, C]."""
    v = tl.reshape(fp8_e4m3_decode(codes, BIAS), (R, C // 32, 32))
    return tl.reshape(v * pow2(scales - 127)[:, :, None], (R, C))


@triton.jit
def mxfp8_quant_kernel(x_ptr, q_ptr, s_ptr, n_rows, K, stride_x, stride_q, stride_s,
                       EMAX: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [R, K] float -> q uint8 E4M3 codes [R, K], s uint8 E8M0 [R, K/32] (ct rule)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    codes, sbytes = _mx_quantize_tile(x, ROWS, BLOCK_K, EMAX, BIAS, FP8_MAX)
    tl.store(q_ptr + r64 * stride_q + cols[None, :], codes.to(tl.uint8), mask=mask)
    g = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    tl.store(s_ptr + r64 * stride_s + g[None, :], sbytes.to(tl.uint8), mask=rmask[:, None] & (g * 32 < K)[None, :])


@triton.jit
def _dot_ieee(a, b, acc):
    """acc + a @ b with fp32 operands and full fp32 products (no TF32 / xf32 rounding of the inputs).

    ``input_precision`` has been ``tl.dot``'s keyword since Triton 3.0 (3.6 and 3.9 both take it).
    """
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _operand(a, OP_F32: tl.constexpr):
    """An activation tile as MMA operand: fp32 (OP_F32) or bf16 (MXFP8-decoded values are exact in bf16)."""
    if OP_F32:
        a = a.to(tl.float32)
    else:
        a = a.to(tl.bfloat16)
    return a


@triton.jit
def _load_a_tile(a_ptr, as_ptr, row_off, srow_off, rmask, k0, K,
                 A_MX: tl.constexpr, OP_F32: tl.constexpr, BIAS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Activation tile [BM, BK]: bf16 (fp32 if OP_F32): plain rows, or MXFP8 codes + scales decoded in registers."""
    kk = k0 + tl.arange(0, BK)
    mask = rmask[:, None] & (kk < K)[None, :]
    if A_MX:
        codes = tl.load(a_ptr + row_off[:, None] + kk[None, :], mask=mask, other=0).to(tl.int32)
        g = k0 // 32 + tl.arange(0, BK // 32)
        sc = tl.load(as_ptr + srow_off[:, None] + g[None, :], mask=rmask[:, None] & (g * 32 < K)[None, :],
                     other=127).to(tl.int32)
        a = _mx_dequantize_tile(codes, sc, BM, BK, BIAS)
    else:
        a = tl.load(a_ptr + row_off[:, None] + kk[None, :], mask=mask, other=0.0)
    return _operand(a, OP_F32)


@triton.jit
def _weight_dot(acc, a, w_ptr, ws_ptr, w_row_off, ws_row_off, nmask, k0, K,
                W_FMT: tl.constexpr, OP_F32: tl.constexpr, DOT_F32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BN] += a [BM, BK] @ W[n, k0:k0+BK]^T for one expert's weight rows (offsets per n).

    OP_F32: ``a`` is fp32, W is decoded to fp32 exactly and the dot is IEEE fp32. Otherwise ``a`` is bf16 and so
    is W (DOT_F32, the interpreter: the same bf16 values, multiplied as fp32).
    """
    # (constexpr branches are if/else chains: Triton compiles the statements after a constexpr-taken return too)
    if W_FMT == 1:
        kk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + w_row_off[None, :] + kk[:, None], mask=nmask[None, :] & (kk < K)[:, None], other=0.0)
        if OP_F32:
            acc = _dot_ieee(a, w.to(tl.float32), acc)  # w [BK, BN]
        elif DOT_F32:  # interpreter: its bf16 tl.dot is wrong
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(a, w.to(tl.bfloat16), acc)
    else:
        kh = k0 // 2 + tl.arange(0, BK // 2)
        wq = tl.load(w_ptr + w_row_off[None, :] + kh[:, None], mask=nmask[None, :] & (kh * 2 < K)[:, None], other=0)
        g = k0 // 32 + tl.arange(0, BK // 32)
        ws = tl.load(ws_ptr + ws_row_off[:, None] + g[None, :], mask=nmask[:, None] & (g * 32 < K)[None, :],
                     other=127)
        if W_FMT == 0:  # wq [BK/2, BN] packed along K, ws [BN, BK/32]
            acc = tl.dot_scaled(a, None, "bf16", wq, ws, "e2m1", acc)
        else:  # manual decode: low nibble = even k, high nibble = odd k
            q = wq.to(tl.int32)
            scale = tl.reshape(tl.broadcast_to(pow2(tl.trans(ws).to(tl.int32) - 127)[:, None, :],
                                               (BK // 32, 16, BN)), (BK // 2, BN))  # [BK/2, BN]
            lo = e2m1_decode(q & 15) * scale  # [BK/2, BN] fp32, exact
            hi = e2m1_decode(q >> 4) * scale
            if not OP_F32:  # exact too: E2M1 x E8M0 has 2 significant bits
                lo = lo.to(tl.bfloat16)
                hi = hi.to(tl.bfloat16)
            w = tl.reshape(tl.trans(tl.join(lo, hi), 0, 2, 1), (BK, BN))  # [BK, BN] interleaved back
            if OP_F32:
                acc = _dot_ieee(a, w, acc)
            elif DOT_F32:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _load_a_cols(a_ptr, as_ptr, row_off, srow_off, rmask, kk, K, A_MX: tl.constexpr, OP_F32: tl.constexpr,
                 BIAS: tl.constexpr):
    """Activation columns ``kk`` [C] of the rows (offsets ``row_off`` [BM]) as bf16 [BM, C] (fp32 if OP_F32)."""
    mask = rmask[:, None] & (kk < K)[None, :]
    a = _x_at(a_ptr, as_ptr, row_off[:, None], srow_off[:, None], kk[None, :], mask, A_MX, BIAS)  # fp32, exact
    return _operand(a, OP_F32)


@triton.jit
def _e2m1_bits(q):
    """fp32 ``E2M1(c) * 2^-126`` of the code in bits 0..3 of int32 ``q`` (higher bits ignored), see below."""
    return (((q & 7) << 22) | ((q & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_f16(q):
    """fp32 ``E2M1(c) * 2^-14`` of the code in bits 0..3 of int32 ``q``: the same bits placed in an fp16.

    ``(c & 7) << 9`` is the fp16 with exponent bits e1 e0 and mantissa bit m (code 1 is the fp16 subnormal
    2^-15), so the conversion to fp32 is exact and the value is a normal fp32 number.
    """
    h = ((q & 7) << 9) | ((q & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_bits_tile(q, f1, f2):
    """E2M1 codes (int32, 0..15) -> fp32 values times the block scale ``f1 * f2``.

    ``(c & 7) << 22`` puts exponent bits e1 e0 and the mantissa bit of the code in fp32 bits 24..22, which is the
    fp32 number ``E2M1(c) * 2^-126`` (code 1 is the subnormal 2^-127); the sign bit moves to bit 31. Multiplying by
    ``f1 = 2^(min(s,128) - 1)`` then ``f2 = 2^(max(s,128) - 128)`` gives ``E2M1(c) * 2^(s - 127)`` exactly
    (two factors so that neither overflows; denormals are preserved on sm_90 and gfx9, see the compile tier).
    """
    return (_e2m1_bits(q) * f1) * f2


@triton.jit
def _bits_dot(acc, a_even, a_odd, w_ptr, ws_ptr, w_row_off, ws_row_off, nmask, k0, K,
              OP_F32: tl.constexpr, DOT_F32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BN] += a[:, k0::2] @ W_even^T + a[:, k0+1::2] @ W_odd^T with the "bits" E2M1 decode."""
    g = k0 // 32 + tl.arange(0, BK // 32)  # [G] scale groups of this K tile
    j = tl.arange(0, 16)  # bytes per scale group
    kh = (g * 16)[:, None, None] + j[None, :, None]  # [G, 16, 1] packed byte index along K/2
    gmask = (g * 32 < K)[:, None, None] & nmask[None, None, :]
    wq = tl.load(w_ptr + w_row_off[None, None, :] + kh, mask=gmask, other=0).to(tl.int32)  # [G, 16, BN]
    s = tl.load(ws_ptr + ws_row_off[None, :] + g[:, None], mask=(g * 32 < K)[:, None] & nmask[None, :],
                other=127).to(tl.int32)[:, None, :]  # [G, 1, BN]
    f1 = pow2(tl.minimum(s, 128) - 1)
    f2 = pow2(tl.maximum(s, 128) - 128)
    lo = tl.reshape(_e2m1_bits_tile(wq & 15, f1, f2), (BK // 2, BN))  # even k
    hi = tl.reshape(_e2m1_bits_tile(wq >> 4, f1, f2), (BK // 2, BN))  # odd k
    if OP_F32:  # a_even / a_odd are fp32
        acc = _dot_ieee(a_even, lo, acc)
        acc = _dot_ieee(a_odd, hi, acc)
    elif DOT_F32:
        acc = tl.dot(a_even.to(tl.float32), lo, acc)
        acc = tl.dot(a_odd.to(tl.float32), hi, acc)
    else:
        acc = tl.dot(a_even, lo.to(tl.bfloat16), acc)
        acc = tl.dot(a_odd, hi.to(tl.bfloat16), acc)
    return acc


@triton.jit
def _fma_dot(acc, a_even, a_odd, w_ptr, ws_ptr, w_row_off, ws_row_off, nmask, k0, K,
             F16_DECODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BN] += a [BM, k0:k0+BK] @ W[n, k0:k0+BK]^T on fp32 multiply-adds (the decode GEMV, no MMA).

    a_even / a_odd [BM, BK/2] fp32 are the even / odd K columns (low / high nibbles). Each thread holds whole
    16-byte scale groups, so the 32-term group sums stay in registers and the E8M0 scale is applied per group.
    F16_DECODE: codes via an fp16 bit pattern (E2M1 * 2^-14, one conversion per element) and the scale
    2^(s-113) per group; otherwise the fp32 pattern (E2M1 * 2^-126) times 2^(min(s,128)-1) per element and
    2^(max(s,128)-128) per group. Both are exact for every E8M0 byte the reference decodes to a finite value
    below 2^127.
    """
    G: tl.constexpr = BK // 32
    g = k0 // 32 + tl.arange(0, G)  # [G] scale groups of this K tile
    kh = (g * 16)[:, None] + tl.arange(0, 16)[None, :]  # [G, 16] packed byte index along K/2
    gmask = nmask[:, None] & (g * 32 < K)[None, :]  # [BN, G]
    wq = tl.load(w_ptr + w_row_off[:, None, None] + kh[None, :, :], mask=gmask[:, :, None],
                 other=0).to(tl.int32)  # [BN, G, 16]
    s = tl.load(ws_ptr + ws_row_off[:, None] + g[None, :], mask=gmask, other=127).to(tl.int32)  # [BN, G]
    ae = tl.reshape(a_even, (BM, 1, G, 16))
    ao = tl.reshape(a_odd, (BM, 1, G, 16))
    if F16_DECODE:
        lo = _e2m1_f16(wq)[None, :, :, :]  # [1, BN, G, 16]
        hi = _e2m1_f16(wq >> 4)[None, :, :, :]
        part = tl.sum(lo * ae + hi * ao, axis=3)  # [BM, BN, G]
        f1 = pow2(tl.minimum(s, 240) - 113)[None, :, :]  # 2^14 * 2^(s-127), split in two factors past byte 240
        f2 = pow2(tl.maximum(s, 240) - 240)[None, :, :]
        acc += tl.sum((part * f1) * f2, axis=2)
    else:
        f1 = pow2(tl.minimum(s, 128) - 1)[:, :, None]  # [BN, G, 1]
        lo = (_e2m1_bits(wq) * f1)[None, :, :, :]
        hi = (_e2m1_bits(wq >> 4) * f1)[None, :, :, :]
        part = tl.sum(lo * ae + hi * ao, axis=3)  # [BM, BN, G]
        acc += tl.sum(part * pow2(tl.maximum(s, 128) - 128)[None, :, :], axis=2)
    return acc


@triton.jit
def _load_a_split(a_ptr, as_ptr, row_off, srow_off, rmask, k0, K, A_MX: tl.constexpr, BIAS: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr):
    """Activation tile [BM, BK] as fp32, split into its even and odd K columns ([BM, BK/2] each)."""
    a = _load_a_tile(a_ptr, as_ptr, row_off, srow_off, rmask, k0, K, A_MX, True, BIAS, BM, BK)
    return tl.split(tl.reshape(a, (BM, BK // 2, 2)))


@triton.jit
def _x_at(a_ptr, as_ptr, row_off, srow_off, kk, kmask, A_MX: tl.constexpr, BIAS: tl.constexpr):
    """fp32 activations of one row at columns ``kk`` (any shape): plain, or MXFP8 codes + scales decoded."""
    if A_MX:
        codes = tl.load(a_ptr + row_off + kk, mask=kmask, other=0).to(tl.int32)
        sc = tl.load(as_ptr + srow_off + kk // 32, mask=kmask, other=127).to(tl.int32)
        a = fp8_e4m3_decode(codes, BIAS) * pow2(sc - 127)
    else:
        a = tl.load(a_ptr + row_off + kk, mask=kmask, other=0.0).to(tl.float32)
    return a


@triton.jit
def _f16_half(h):
    """fp32 value of the fp16 bit pattern in the low 16 bits of int32 ``h``."""
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_words(acc, wv, s, xs, F16_DECODE: tl.constexpr):
    """acc [BN, 4, G] += E2M1 words ``wv`` (int32: 8 codes = K elements 8m .. 8m+7 of group g) . ``xs`` x scale.

    xs: the 8 activation tiles (tuple of [BN, 4, G] fp32, element i of each word); s: E8M0 bytes [BN, 4, G].
    F16_DECODE works on code pairs (j, j + 4), 16 bits apart: one shift puts both magnitudes at fp16 bits 9..11
    and 25..27, another both signs at bits 15 and 31, so each pair costs two shifts and two logic ops, then one
    fp16 -> fp32 conversion per value.
    """
    part = tl.zeros(acc.shape, tl.float32)
    if F16_DECODE:
        for j in tl.static_range(4):
            if j < 3:
                t = wv << (9 - 4 * j)
            else:
                t = wv >> 3
            h2 = (t & 0x0E000E00) | ((wv << (12 - 4 * j)) & -2147450880)  # -2147450880 = 0x80008000
            part += _f16_half(h2) * xs[j]
            part += _f16_half(h2 >> 16) * xs[j + 4]
        # 2^14 * 2^(s - 127) = 2^(s - 113) as two normal fp32 factors built from their exponent fields
        f1 = ((tl.minimum(s, 240) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(min(s, 240) - 113)
        f2 = ((tl.maximum(s, 240) - 113) << 23).to(tl.float32, bitcast=True)  # 2^(max(s, 240) - 240)
        return acc + (part * f1) * f2
    else:
        f1 = pow2(tl.minimum(s, 128) - 1)
        for i in tl.static_range(8):
            part += (_e2m1_bits(wv >> (4 * i)) * f1) * xs[i]
        return acc + part * pow2(tl.maximum(s, 128) - 128)


@triton.jit
def _gemv_tile(w_ptr, ws_ptr, w_row_off, ws_row_off, nmask, k0, K, BN: tl.constexpr, G: tl.constexpr):
    """One weight tile as (int32 words [BN, 4, G], E8M0 bytes [BN, 4, G], word mask): group g, word m.

    Word offsets are marked non-contiguous so the weight, scale and activation tiles all get the same
    one-element-per-lane register layout (no shared-memory layout conversions in the K loop).
    """
    m = tl.arange(0, 4)[None, :, None]  # [1, 4, 1]
    g = (k0 // 32 + tl.arange(0, G))[None, None, :]  # [1, 1, G]
    n0 = tl.zeros((BN, 1, 1), tl.int32)
    msk = nmask[:, None, None] & (g * 32 < K) & (m < 4)  # [BN, 4, G]
    words = tl.max_contiguous(tl.multiple_of(n0 + g * 4 + m, [1, 1, 1]), [1, 1, 1])
    wv = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + (w_row_off // 4)[:, None, None] + words, mask=msk, other=0)
    s = tl.load(ws_ptr + ws_row_off[:, None, None] + (n0 + g + 0 * m), mask=msk, other=127).to(tl.int32)
    return wv, s, msk


@triton.jit
def _bf16_pair(w):
    """(low, high) bf16 halves of int32 words as fp32 (bf16 is the top half of an fp32)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_x(a_ptr, as_ptr, row_off, srow_off, k0, K, A_MX: tl.constexpr, BIAS: tl.constexpr,
            BN: tl.constexpr, G: tl.constexpr):
    """The 8 activation tiles of one K step, each [BN, 4, G] (rows repeat the same values): x[k0 + 32g + 8m + i].

    bf16 rows are read as int32 pairs (4 loads per 8 values, unpacked with one logic op each)."""
    m = tl.arange(0, 4)[None, :, None]
    g = (k0 // 32 + tl.arange(0, G))[None, None, :]
    kk = tl.zeros((BN, 1, 1), tl.int32) + g * 32 + m * 8  # [BN, 4, G]
    kmask = kk < K
    if a_ptr.dtype.element_ty == tl.bfloat16 and not A_MX:
        pairs = a_ptr.to(tl.pointer_type(tl.int32)) + row_off // 2 + kk // 2
        x0, x1 = _bf16_pair(tl.load(pairs, mask=kmask, other=0))
        x2, x3 = _bf16_pair(tl.load(pairs + 1, mask=kmask, other=0))
        x4, x5 = _bf16_pair(tl.load(pairs + 2, mask=kmask, other=0))
        x6, x7 = _bf16_pair(tl.load(pairs + 3, mask=kmask, other=0))
        return x0, x1, x2, x3, x4, x5, x6, x7
    return (_x_at(a_ptr, as_ptr, row_off, srow_off, kk, kmask, A_MX, BIAS),
            _x_at(a_ptr, as_ptr, row_off, srow_off, kk + 1, kmask, A_MX, BIAS),
            _x_at(a_ptr, as_ptr, row_off, srow_off, kk + 2, kmask, A_MX, BIAS),
            _x_at(a_ptr, as_ptr, row_off, srow_off, kk + 3, kmask, A_MX, BIAS),
            _x_at(a_ptr, as_ptr, row_off, srow_off, kk + 4, kmask, A_MX, BIAS),
            _x_at(a_ptr, as_ptr, row_off, srow_off, kk + 5, kmask, A_MX, BIAS),
            _x_at(a_ptr, as_ptr, row_off, srow_off, kk + 6, kmask, A_MX, BIAS),
            _x_at(a_ptr, as_ptr, row_off, srow_off, kk + 7, kmask, A_MX, BIAS))


@triton.jit
def _gemv_finish(acc3, BN: tl.constexpr):
    """[BN, 4, G] lane partials -> [1, BN]."""
    return tl.reshape(tl.sum(tl.sum(acc3, axis=2), axis=1), (1, BN))


@triton.jit
def _gemv_rows(a_ptr, as_ptr, row_off, srow_off, w_ptr, ws_ptr, w1_off, s1_off, w2_off, s2_off, nmask, K,
               TWO: tl.constexpr, A_MX: tl.constexpr, BIAS: tl.constexpr, F16_DECODE: tl.constexpr,
               BN: tl.constexpr, G: tl.constexpr):
    """One activation row against BN weight rows (offsets ``w1_off``; a second set ``w2_off`` when TWO): the
    W_FMT 5 decode GEMV over the whole K -> ([1, BN], [1, BN]) fp32.

    The weight words and scales of step k + 1 are loaded before step k is computed (register double buffering:
    Triton does not pipeline loads that feed no dot), so each warp keeps two steps of HBM reads in flight.
    """
    acc1 = tl.zeros((BN, 4, G), tl.float32)
    acc2 = tl.zeros((BN, 4, G), tl.float32)
    w1, s1, _ = _gemv_tile(w_ptr, ws_ptr, w1_off, s1_off, nmask, 0, K, BN, G)
    w2, s2 = w1, s1
    if TWO:
        w2, s2, _ = _gemv_tile(w_ptr, ws_ptr, w2_off, s2_off, nmask, 0, K, BN, G)
    for k0 in range(0, K, 32 * G):
        w1n, s1n, _ = _gemv_tile(w_ptr, ws_ptr, w1_off, s1_off, nmask, k0 + 32 * G, K, BN, G)  # masked past K
        w2n, s2n = w1n, s1n
        if TWO:
            w2n, s2n, _ = _gemv_tile(w_ptr, ws_ptr, w2_off, s2_off, nmask, k0 + 32 * G, K, BN, G)
        xs = _gemv_x(a_ptr, as_ptr, row_off, srow_off, k0, K, A_MX, BIAS, BN, G)
        acc1 = _gemv_words(acc1, w1, s1, xs, F16_DECODE)
        if TWO:
            acc2 = _gemv_words(acc2, w2, s2, xs, F16_DECODE)
        w1, s1, w2, s2 = w1n, s1n, w2n, s2n
    return _gemv_finish(acc1, BN), _gemv_finish(acc2, BN)


@triton.jit
def w13_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, out_s_ptr,
               sorted_ptr, block_expert_ptr, start_ptr, count_ptr,
               K, N, top_k, stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
               stride_out, stride_out_s, beta, linear_beta,
               A_MX: tl.constexpr, W_FMT: tl.constexpr, OP_F32: tl.constexpr, DOT_F32: tl.constexpr, ACT: tl.constexpr,
               HAS_LINEAR_BETA: tl.constexpr,
               OUT_MX: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
               F16_DECODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """inter[p, n] = act(x[tok(p)] @ W1_e[n]^T, x[tok(p)] @ W3_e[n]^T) for the BM rows p of block pid_m.

    a: x [T, K] (or its MXFP8 codes + scales); w: w13 [E, 2N, K/2] u8 (+ scales [E, 2N, K/32]) or [E, 2N, K] bf16.
    out: [P_max, N] activation dtype, or (OUT_MX) E4M3 codes u8 [P_max, N] + scales u8 [P_max, N/32].
    """
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    row_end = tl.load(start_ptr + expert) + tl.load(count_ptr + expert)
    rows = pid_m * BM + tl.arange(0, BM)  # [BM] padded-layout rows
    rmask = rows < row_end
    tok = (tl.load(sorted_ptr + rows, mask=rmask, other=0) // top_k).to(tl.int64)  # [BM]
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    nmask = n < N
    e64 = expert.to(tl.int64)
    wg_off = e64 * stride_we + n.to(tl.int64) * stride_wn  # gate rows
    wu_off = wg_off + N * stride_wn  # up rows
    sg_off = e64 * stride_wse + n.to(tl.int64) * stride_wsn
    su_off = sg_off + N * stride_wsn
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    if W_FMT == 5:  # BM = 1: the block's one token
        tok0 = tl.sum(tok, axis=0)
        acc_g, acc_u = _gemv_rows(a_ptr, as_ptr, tok0 * stride_a, tok0 * stride_as, w_ptr, ws_ptr, wg_off, sg_off,
                                  wu_off, su_off, nmask, K, True, A_MX, BIAS, F16_DECODE, BN, BK // 32)
    else:
        ra, rs = tok * stride_a, tok * stride_as  # [BM] activation / scale row offsets
        for k0 in range(0, K, BK):
            if W_FMT == 4:
                a_ev, a_od = _load_a_split(a_ptr, as_ptr, ra, rs, rmask, k0, K, A_MX, BIAS, BM, BK)
                acc_g = _fma_dot(acc_g, a_ev, a_od, w_ptr, ws_ptr, wg_off, sg_off, nmask, k0, K, F16_DECODE, BM, BN, BK)
                acc_u = _fma_dot(acc_u, a_ev, a_od, w_ptr, ws_ptr, wu_off, su_off, nmask, k0, K, F16_DECODE, BM, BN, BK)
            elif W_FMT == 3:
                ke = k0 + 2 * tl.arange(0, BK // 2)
                a_ev = _load_a_cols(a_ptr, as_ptr, ra, rs, rmask, ke, K, A_MX, OP_F32, BIAS)
                a_od = _load_a_cols(a_ptr, as_ptr, ra, rs, rmask, ke + 1, K, A_MX, OP_F32, BIAS)
                acc_g = _bits_dot(acc_g, a_ev, a_od, w_ptr, ws_ptr, wg_off, sg_off, nmask, k0, K, OP_F32, DOT_F32,
                                  BN, BK)
                acc_u = _bits_dot(acc_u, a_ev, a_od, w_ptr, ws_ptr, wu_off, su_off, nmask, k0, K, OP_F32, DOT_F32,
                                  BN, BK)
            else:
                a = _load_a_tile(a_ptr, as_ptr, ra, rs, rmask, k0, K, A_MX, OP_F32, BIAS, BM, BK)
                acc_g = _weight_dot(acc_g, a, w_ptr, ws_ptr, wg_off, sg_off, nmask, k0, K, W_FMT, OP_F32, DOT_F32,
                                    BN, BK)
                acc_u = _weight_dot(acc_u, a, w_ptr, ws_ptr, wu_off, su_off, nmask, k0, K, W_FMT, OP_F32, DOT_F32,
                                    BN, BK)
    if ACT == 0:  # SiTU: beta tanh(g/beta) sigmoid(g) * (lb tanh(u/lb) | u)
        gate = beta * tanh_f32(acc_g / beta) * tl.sigmoid(acc_g)
        if HAS_LINEAR_BETA:
            up = linear_beta * tanh_f32(acc_u / linear_beta)
        else:
            up = acc_u
    else:  # SiLU(g) * u
        gate = acc_g * tl.sigmoid(acc_g)
        up = acc_u
    act = gate * up  # [BM, BN] fp32
    r64 = rows.to(tl.int64)
    omask = rmask[:, None] & nmask[None, :]
    if OUT_MX:
        codes, sbytes = _mx_quantize_tile(act, BM, BN, EMAX, BIAS, FP8_MAX)
        tl.store(out_ptr + r64[:, None] * stride_out + n[None, :], codes.to(tl.uint8), mask=omask)
        g = tl.program_id(1) * (BN // 32) + tl.arange(0, BN // 32)
        tl.store(out_s_ptr + r64[:, None] * stride_out_s + g[None, :], sbytes.to(tl.uint8),
                 mask=rmask[:, None] & (g * 32 < N)[None, :])
    else:
        tl.store(out_ptr + r64[:, None] * stride_out + n[None, :], act.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def w2_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, topk_w_ptr,
              sorted_ptr, block_expert_ptr, start_ptr, count_ptr,
              K, N, stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_y,
              A_MX: tl.constexpr, W_FMT: tl.constexpr, OP_F32: tl.constexpr, DOT_F32: tl.constexpr, BIAS: tl.constexpr,
              F16_DECODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[pair(p), n] = topk_w[pair(p)] * inter[p] @ W2_e[n]^T for the rows p of block pid_m (K = intermediate)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    row_end = tl.load(start_ptr + expert) + tl.load(count_ptr + expert)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < row_end
    pair = tl.load(sorted_ptr + rows, mask=rmask, other=0).to(tl.int64)  # [BM]
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    e64 = expert.to(tl.int64)
    w_off = e64 * stride_we + n.to(tl.int64) * stride_wn
    s_off = e64 * stride_wse + n.to(tl.int64) * stride_wsn
    r64 = rows.to(tl.int64)
    acc = tl.zeros((BM, BN), tl.float32)
    if W_FMT == 5:  # BM = 1: the block's one row
        row0 = tl.sum(r64, axis=0)
        acc, _ = _gemv_rows(a_ptr, as_ptr, row0 * stride_a, row0 * stride_as, w_ptr, ws_ptr, w_off, s_off, w_off,
                            s_off, nmask, K, False, A_MX, BIAS, F16_DECODE, BN, BK // 32)
    else:
        ra, rs = r64 * stride_a, r64 * stride_as  # [BM] activation / scale row offsets
        for k0 in range(0, K, BK):
            if W_FMT == 4:
                a_ev, a_od = _load_a_split(a_ptr, as_ptr, ra, rs, rmask, k0, K, A_MX, BIAS, BM, BK)
                acc = _fma_dot(acc, a_ev, a_od, w_ptr, ws_ptr, w_off, s_off, nmask, k0, K, F16_DECODE, BM, BN, BK)
            elif W_FMT == 3:
                ke = k0 + 2 * tl.arange(0, BK // 2)
                a_ev = _load_a_cols(a_ptr, as_ptr, ra, rs, rmask, ke, K, A_MX, OP_F32, BIAS)
                a_od = _load_a_cols(a_ptr, as_ptr, ra, rs, rmask, ke + 1, K, A_MX, OP_F32, BIAS)
                acc = _bits_dot(acc, a_ev, a_od, w_ptr, ws_ptr, w_off, s_off, nmask, k0, K, OP_F32, DOT_F32, BN, BK)
            else:
                a = _load_a_tile(a_ptr, as_ptr, ra, rs, rmask, k0, K, A_MX, OP_F32, BIAS, BM, BK)
                acc = _weight_dot(acc, a, w_ptr, ws_ptr, w_off, s_off, nmask, k0, K, W_FMT, OP_F32, DOT_F32, BN, BK)
    rw = tl.load(topk_w_ptr + pair, mask=rmask, other=0.0)  # [BM] routing weights
    tl.store(y_ptr + pair[:, None] * stride_y + n[None, :], acc * rw[:, None], mask=rmask[:, None] & nmask[None, :])


@triton.jit
def topk_reduce_kernel(y_ptr, out_ptr, Kout, stride_y, stride_out, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum_j y[t * TOP_K + j] (fp32, fixed order, deterministic), cast to the output dtype."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < Kout
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_y + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
