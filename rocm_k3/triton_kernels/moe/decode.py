"""In-register decode of one 128-row x BK tile of ``triton``-layout MXFP4 weights (:mod:`.layout`).

:func:`weight_tile` loads the tile's 16-byte code chunks and its 8-byte scale groups and returns the weights
``W[row, k] = E2M1 * 2^(s - 127)`` as ``[128, BK]`` (rows ``0..63`` = row group ``g0``, ``64..127`` = ``g0 + 1``),
bf16 for the MMA or fp32 (``OUT_F32``: the fp32-operand path and the interpreter). Two implementations of the same
bytes, chosen by the ``DECODE`` constexpr:

- ``DECODE_ASM`` (NVIDIA sm_90+): one ``tl.inline_asm_elementwise`` per 32-bit word (pack=4 over its bytes):
  ``and`` / ``shl`` / ``shr`` / one funnel rotate / ``or`` (9 integer ops: 5 LOP3 after ptxas fuses and/or, two
  shifts it may issue as IMAD on the FMA pipe, two on the ALU; the layout's bit positions make them the fewest)
  make four bf16x2 registers ``E2M1 * 2^-126`` and one ``mul.rn.bf16x2`` each applies ``2^(s - 1)`` (``FOLD``:
  every scale byte <= 128) or ``2^126`` then ``2^(s - 127)``: about 1.6 instructions per weight. The asm input
  registers are the bytes of the 16-byte load as loaded: the layout puts each thread's MMA operand in its own
  chunk, so the reshapes after the asm only relabel registers.
- ``DECODE_PORTABLE`` (the interpreter, AMD targets, fp32 operands, the grouped path's dequant kernel): the same
  masks on int32 words in Triton, each bf16 half moved to an fp32 word and re-biased to the exact fp32 E2M1 value
  (:func:`_half_value`; the reference ``rocm_k3.quant.e2m1_values`` of its code, bit for bit), times the exact fp32 scale. It checks the
  layout and the bit formulas the asm uses, without the asm.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rocm_k3.triton_kernels.moe.mx import pow2

DECODE_ASM = 0
DECODE_PORTABLE = 1

# $0..$3: the four bf16x2 registers of one word ($4); $5: the bf16 multipliers of rows r (low half) and r + 8
# (high half), broadcast to both halves by the multiply's operand selectors (``pack=4`` passes it once per byte
# of the word: $5..$8 are the same register).
_UNPACK = """
.reg .b32 t0, t1, t2;
.reg .b16 r0, r8;
and.b32 $0, $4, 0x81C081C0;
shl.b32 t0, $4, 4;
and.b32 $1, t0, 0x81C081C0;
shf.l.wrap.b32 t1, $4, $4, 10;
and.b32 $2, t1, 0x81C081C0;
shl.b32 t0, $4, 6;
and.b32 t0, t0, 0x80C080C0;
shr.b32 t1, $4, 2;
and.b32 t1, t1, 0x01000100;
or.b32 $3, t0, t1;
"""
_SCALE = """
mov.b32 {r0, r8}, $5;
mov.b32 t1, {r0, r0};
mov.b32 t2, {r8, r8};
mul.rn.bf16x2 $0, $0, t1;
mul.rn.bf16x2 $1, $1, t2;
mul.rn.bf16x2 $2, $2, t1;
mul.rn.bf16x2 $3, $3, t2;
"""
_BIAS = """
mov.b32 t0, 0x7E807E80;
mul.rn.bf16x2 $0, $0, t0;
mul.rn.bf16x2 $1, $1, t0;
mul.rn.bf16x2 $2, $2, t0;
mul.rn.bf16x2 $3, $3, t0;
"""
ASM_FOLD = tl.constexpr("{" + _UNPACK + _SCALE + "}")  # scale register = bf16x2 2^(s - 1)
ASM_TWO_MUL = tl.constexpr("{" + _UNPACK + _BIAS + _SCALE + "}")  # x 2^126, then x 2^(s - 127)
ASM_TEXTS = {True: ASM_FOLD.value, False: ASM_TWO_MUL.value}  # for tests (tests/ops/test_moe_layout.py emulates them)


@triton.jit
def _chunk_offsets(KU: tl.constexpr):
    """[KU, 4, 8, 4, 16] byte offsets of the thread chunks of one row group: unit, warp w, g, q, byte."""
    u = tl.arange(0, KU)[:, None, None, None, None]
    w = tl.arange(0, 4)[None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, :, None, None]
    q = tl.arange(0, 4)[None, None, None, :, None]
    b = tl.arange(0, 16)[None, None, None, None, :]
    return u * 2048 + ((w * 8 + g) * 4 + q) * 16 + b


@triton.jit
def _scale_words(ws_ptr, stride_sg, KU: tl.constexpr):
    """Scale bytes of the tile as int32 words [2 groups, KU units, 4 w, 8 g]: bytes (h, s1) = (0,0) (0,1) (1,0)
    (1,1) of rows r = 16w + g (h = 0) and r + 8, MX blocks s1 of the unit (one 8-byte load per 128 K)."""
    sub = tl.arange(0, 2)[:, None, None, None]
    kg = tl.arange(0, KU // 2)[None, :, None, None]
    wg = tl.arange(0, 32)[None, None, :, None]
    u = tl.arange(0, 2)[None, None, None, :]
    s = tl.load(ws_ptr.to(tl.pointer_type(tl.int32)) + sub * (stride_sg // 4) + kg * 64 + wg * 2 + u)
    s = tl.permute(tl.reshape(s, (2, KU // 2, 4, 8, 2)), (0, 1, 4, 2, 3))  # sub kg u w g
    return tl.reshape(s, (2, KU, 4, 8))


@triton.jit
def _to_tile(v, IDX_E: tl.constexpr, KU: tl.constexpr):
    """[2 sub, KU, 4 w, 8 g, 4 q, 2 s1, 2 s0, then (h, e) in either order, 2 c] -> [128, 64 KU] with
    row = 64 sub + 16 w + 8 h + g, k = 64 u + 32 s1 + 16 s0 + 8 c + 2 q + e (the layout's element map).
    IDX_E: the position (7 or 8) of the e dim; h is the other one."""
    if IDX_E == 8:
        v = tl.permute(v, (0, 2, 7, 3, 1, 5, 6, 9, 4, 8))  # sub w h g u s1 s0 c q e
    else:
        v = tl.permute(v, (0, 2, 8, 3, 1, 5, 6, 9, 4, 7))
    return tl.reshape(v, (128, 64 * KU))


@triton.jit
def _asm_tile(w_ptr, ws_ptr, stride_wg, stride_sg, FOLD: tl.constexpr, KU: tl.constexpr):
    sub = tl.arange(0, 2)[:, None, None, None, None, None]
    codes = tl.load(w_ptr + sub * stride_wg + _chunk_offsets(KU)[None])  # uint8 [2, KU, 4, 8, 4, 16]
    codes = tl.reshape(codes, (2, KU, 4, 8, 4, 2, 2, 4))  # ... s1 s0 [byte = 2h + e]
    sw = _scale_words(ws_ptr, stride_sg, KU)
    pair = tl.join(sw & 0x00FF00FF, (sw >> 8) & 0x00FF00FF)  # [2, KU, 4, 8, 2 s1]: scale bytes of rows r | r + 8
    if FOLD:
        mult = pair * 128 + 0x3F003F00  # bf16 bits of 2^(s - 1) per half: exponent field s + 126
    else:  # bf16 bits of 2^(s - 127) per half; byte 0 is the subnormal 2^-127
        mult = pair * 128 | tl.where((pair & 0xFF) == 0, 0x40, 0) | tl.where((pair >> 16) == 0, 0x400000, 0)
    mult = tl.reshape(mult, (2, KU, 4, 8, 1, 2, 1, 1))  # sub u w g [q] s1 [s0] [byte]
    mult = tl.broadcast_to(mult, (2, KU, 4, 8, 4, 2, 2, 4))
    lo, hi = tl.inline_asm_elementwise(ASM_FOLD if FOLD else ASM_TWO_MUL, "=r,=r,=r,=r,r,r,r,r,r", [codes, mult],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    v = tl.reshape(tl.join(lo, hi), (2, KU, 4, 8, 4, 2, 2, 2, 2, 2))  # ... s1 s0 h e c
    return _to_tile(v, 8, KU)


@triton.jit
def _half_value(o, HIGH: tl.constexpr, scale):
    """fp32 value of the bf16 half (low or HIGH) of int32 ``o`` (pattern E2M1 * 2^-126) times ``scale``.

    Straight from the bits, no code extraction: the half moved to the top of an fp32 word keeps its sign (bit 31),
    E2M1 exponent E (bits 24..23) and mantissa M (bit 22); adding 126 to the fp32 exponent field gives
    2^(E-1) (1 + M/2) for E > 0, and E = 0 (0 or the subnormal 0.5) becomes exactly 0.5 M (+ 0x3EC00000 when M
    is set, nothing when not). Equal, bit for bit, to ``e2m1_values()[code] * scale`` (exhaustive interpreter test),
    in 7 integer ops instead of ~19."""
    if HIGH:
        b = o & -65536  # 0xFFFF0000
    else:
        b = o << 16
    add = tl.where((b & 0x01800000) != 0, 0x3F000000, (b & 0x00400000) * 251)
    return (b + add).to(tl.float32, bitcast=True) * scale


@triton.jit
def _portable_tile(w_ptr, ws_ptr, stride_wg, stride_sg, KU: tl.constexpr):
    sub = tl.arange(0, 2)[:, None, None, None, None, None]
    word = tl.arange(0, 4)[None, None, None, None, None, :]
    u = tl.arange(0, KU)[None, :, None, None, None, None]
    w = tl.arange(0, 4)[None, None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, None, :, None, None]
    q = tl.arange(0, 4)[None, None, None, None, :, None]
    offs = sub * (stride_wg // 4) + u * 512 + ((w * 8 + g) * 4 + q) * 4 + word
    words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + offs)  # [2, KU, 4, 8, 4, 4 = (s1, s0)]
    words = tl.reshape(words, (2, KU, 4, 8, 4, 2, 2))
    sw = _scale_words(ws_ptr, stride_sg, KU)
    s = tl.join(sw & 0xFF, (sw >> 8) & 0xFF)  # row r, MX blocks s1 = 0, 1: [2, KU, 4, 8, 2]
    s8 = tl.join((sw >> 16) & 0xFF, (sw >> 24) & 0xFF)  # row r + 8
    # exact fp32 scales (byte 255 is NaN in E8M0; the loaders reject it), [2, KU, 4, 8, 1 q, 2 s1, 1 s0]
    f0 = tl.reshape(pow2(tl.minimum(s, 254) - 127), (2, KU, 4, 8, 1, 2, 1))
    f1 = tl.reshape(pow2(tl.minimum(s8, 254) - 127), (2, KU, 4, 8, 1, 2, 1))
    m = -2118090304  # 0x81C081C0 as int32 (>> is arithmetic on int32: every right shift is masked below 2^31)
    o0 = words & m
    o1 = (words << 4) & m
    o2 = ((words << 10) & (m & ~0x3FF)) | ((words >> 22) & (m & 0x3FF))  # rotl(words, 10) & m
    o3 = ((words << 6) & -2134867776) | ((words >> 2) & 0x01000100)  # 0x80C080C0
    c0 = tl.join(tl.join(_half_value(o0, False, f0), _half_value(o0, True, f0)),
                 tl.join(_half_value(o1, False, f1), _half_value(o1, True, f1)))  # [..., e, h]
    c1 = tl.join(tl.join(_half_value(o2, False, f0), _half_value(o2, True, f0)),
                 tl.join(_half_value(o3, False, f1), _half_value(o3, True, f1)))
    return _to_tile(tl.join(c0, c1), 7, KU)  # ... s1 s0 e h c


@triton.jit
def weight_tile(w_ptr, ws_ptr, stride_wg, stride_sg, DECODE: tl.constexpr, FOLD: tl.constexpr,
                OUT_F32: tl.constexpr, KU: tl.constexpr):
    """Decoded weights [128, 64 KU] of the row groups at ``w_ptr`` / ``w_ptr + stride_wg`` (codes) and ``ws_ptr`` /
    ``ws_ptr + stride_sg`` (scales), both already offset to the tile's first K group; bf16, or fp32 if OUT_F32."""
    if DECODE == 0:
        tile = _asm_tile(w_ptr, ws_ptr, stride_wg, stride_sg, FOLD, KU)
        if OUT_F32:
            tile = tile.to(tl.float32)
    else:
        tile = _portable_tile(w_ptr, ws_ptr, stride_wg, stride_sg, KU)
        if not OUT_F32:
            tile = tile.to(tl.bfloat16)  # exact: E2M1 x 2^e has 2 significant bits
    return tile
