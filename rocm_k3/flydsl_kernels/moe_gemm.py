"""FlyDSL MXFP4 MoE GEMMs (stage 1: w13 + SiTU, stage 2: w2 + routing weight), compile-verified only.

Not yet run on an AMD GPU: these kernels compile for gfx942 and gfx950 and their index maps are tested on
the host (``plans``/``weights``), nothing more.

Rows are (token, slot) pairs sorted by expert and padded to blocks of 16 (``moe_align``); a workgroup takes
one 16-row block (one expert) and 4 waves x ``tiles`` 16-column MFMA tiles; the K loop runs over groups of
128 (4 MX blocks), each lane reading one 16-byte vector of pre-shuffled FP4 codes per tile and group
(``weights``) and one scale dword.

- stage 1: A = x rows gathered by token (``pair // top_k``), B = w13 gate rows n and up rows N + n;
  epilogue h = act(gate, up) (SiTU or SiLU, fp32) written to H [P, N].
- stage 2: A = H rows (the block rows themselves), B = w2; epilogue topk_weight[pair] * acc written to
  Y [T*top_k, Kout] at the pair's row (padding rows skipped); ``moe_reduce`` sums the top-k rows.

Per target and activation format (``a_format``):
- "bf16" (A16W4): FP4 codes are decoded in registers to bf16 times their E8M0 scale (exact; integer ops on
  gfx942, ``v_cvt_scalef32_pk_bf16_fp4`` on gfx950) and fed to
  ``v_mfma_f32_16x16x16_bf16`` (gfx942, 4 K per lane, 8 steps per group) or ``v_mfma_f32_16x16x32_bf16``
  (gfx950, 8 K per lane, 4 steps).
- "fp8" (A8W4), gfx942: A is MXFP8 in FNUZ e4m3 (``mxfp8_quant``), FP4 codes map exactly to FNUZ e4m3
  bytes, one ``v_mfma_f32_16x16x32_fp8_fp8`` per MX block ("step" layout: a step never mixes MX blocks),
  and the fp32 result of each step is scaled by 2^(sa + sb - 254) per (row, column) before accumulation.
- "fp8" (A8W4), gfx950: A is MXFP8 in OCP e4m3, B stays FP4, one ``v_mfma_scale_f32_16x16x128_f8f6f4``
  per group with per-lane E8M0 scales for A and B ("lane" layout: lane group q owns MX block q).

Mapping to the Triton twin (``triton_kernels/moe``): the same expert-sorted, padded row blocks (Triton uses
BM = 16 at decode and 64 at prefill; here always 16), the same E8M0 group of 32, fp32 accumulation, SiTU
in the w13 epilogue and the routing weight in the w2 epilogue, then the same fp32 top-k reduction. Triton
quantises h to MXFP8 inside the w13 epilogue; here a separate ``mxfp8_quant`` pass does it (h kept in fp32
in between, the same values the reference quantises). On gfx950 the A16W4 path decodes FP4 to bf16 and
uses the bf16 MFMA (activations are not MX data); only A8W4 uses the scaled MFMA.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr.rocdl import cdna4
from flydsl.expr.typing import T

from rocm_k3.flydsl_kernels import bitcodes, common
from rocm_k3.flydsl_kernels.plans import (
    MOE_BLOCK_M,
    MOE_K_GROUP,
    mfma_ab_row,
    mfma_c_coord,
    moe_dword_k,
    moe_dword_pos,
    moe_scale_slot,
    moe_steps,
)
from rocm_k3.flydsl_kernels.weights import layout_for_arch

WAVES = 4


@dataclasses.dataclass(frozen=True)
class MoeGemmConfig:
    """Static configuration of one MoE GEMM stage.

    arch: gfx942 | gfx950; stage: 1 (w13 + activation) | 2 (w2 + routing weight);
    a_format: "bf16" (A16W4) | "fp8" (A8W4); K: reduction size; N: output columns (the intermediate size
    for stage 1 — each of gate and up — or Kout for stage 2); top_k; a_dtype: dtype of a bf16-format A
    (bf16 or f16 x for stage 1, the H dtype for stage 2); out_dtype: H dtype written by stage 1;
    activation: ("situ", beta, linear_beta or None) | ("silu", 0, None); tiles: 16-column tiles per wave.
    """

    arch: str
    stage: int
    a_format: str
    K: int
    N: int
    top_k: int
    a_dtype: str = "bf16"
    out_dtype: str = "bf16"
    activation: tuple = ("situ", 4.0, 25.0)
    tiles: int = 2

    def __post_init__(self) -> None:
        layout_for_arch(self.arch)  # validates arch
        if self.stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {self.stage}")
        if self.a_format not in ("bf16", "fp8"):
            raise ValueError(f"a_format must be 'bf16' or 'fp8', got {self.a_format!r}")
        if self.K % MOE_K_GROUP:
            raise ValueError(f"K={self.K} must be a multiple of {MOE_K_GROUP}")
        if self.N % self.block_n:
            raise ValueError(f"N={self.N} must be a multiple of the workgroup tile {self.block_n}")
        if self.a_format == "bf16" and self.a_dtype not in ("bf16", "f16"):
            raise ValueError(f"bf16-format A must be bf16 or f16, got {self.a_dtype}")
        if self.activation[0] not in ("situ", "silu"):
            raise ValueError(f"activation must be situ or silu, got {self.activation}")

    @property
    def layout(self) -> str:
        return layout_for_arch(self.arch)

    @property
    def kpl(self) -> int:
        """K values per lane in one MFMA step."""
        if self.a_format == "fp8":
            return 8 if self.arch == "gfx942" else 32
        return 4 if self.arch == "gfx942" else 8

    @property
    def block_n(self) -> int:
        return WAVES * self.tiles * 16


def _e8m0_to_f32(byte):
    """2^(byte - 127) as fp32 (byte 0 is the subnormal 2^-127), from an int32 holding the byte."""
    return bitcodes.e8m0_to_f32_bits(byte, bitcodes.dsl_select).bitcast(fx.Float32)


def _fp4_to_bf16(word, scale, arch: str):
    """8 E2M1 codes of an int32 (low nibble first) -> 8 bf16 values times ``scale`` (exact).

    gfx950 has the instruction (``v_cvt_scalef32_pk_bf16_fp4``: two codes per call); gfx942 builds the bf16
    bit patterns with integer ops and multiplies by the scale in fp32.
    """
    if arch == "gfx950":
        pairs = [fx.Vector(fx.rocdl.cvt_scalef32_pk_bf16_fp4(T.vec(2, T.bf16), word, scale, sel))
                 for sel in range_constexpr(4)]
        return fx.Vector.from_elements([pr[j] for pr in pairs for j in range_constexpr(2)], fx.BFloat16)
    vals = []
    for p in range_constexpr(8):
        bits = bitcodes.e2m1_to_bf16_bits((word >> (4 * p)) & 15, bitcodes.dsl_select)
        vals.append((bits << 16).bitcast(fx.Float32) * scale)
    return fx.Vector.from_elements(vals, fx.Float32).to(fx.BFloat16)


def _fp4_to_fp8_words(word, fnuz: bool):
    """8 E2M1 codes -> 8 e4m3 bytes (FNUZ or OCP, exact) packed in two int32 (byte p = code p)."""
    words = []
    for half in range_constexpr(2):
        acc = fx.Int32(0)
        for i in range_constexpr(4):
            byte = bitcodes.e2m1_to_e4m3_byte((word >> (4 * (half * 4 + i))) & 15, fnuz, bitcodes.dsl_select)
            acc = acc | (byte << (8 * i))
        words.append(acc)
    return words


def _pick(values, index):
    """values[index] for a runtime index in 0..3 (a select chain)."""
    return (index == 0).select(values[0], (index == 1).select(values[1], (index == 2).select(values[2], values[3])))


def build_moe_gemm(cfg: MoeGemmConfig):
    """``launch(A, AScale, Sorted, BlockExpert, Wq, Ws, Out, TopW, num_pairs, num_blocks)``.

    A: stage 1 x [T, K] (bf16) or x codes [T, K] uint8 (fp8); stage 2 H [P, K] or its codes [P, K] uint8.
    AScale: uint8 [rows, K/32] E8M0 scales of an fp8 A (any tensor for bf16). Sorted int32 [P] pair ids
    (>= num_pairs marks padding), BlockExpert int32 [P/16]. Wq int32 [E, R/16, K/128, 64, 4] and Ws uint8
    [E, R/16, K/128, 16, 4] (``weights.preshuffle_codes``). Out: stage 1 H [P, N]; stage 2 Y fp32 [num_pairs, N].
    TopW fp32 [num_pairs] (flattened topk weights; stage 2 only).
    """
    layout, kpl, steps = cfg.layout, cfg.kpl, moe_steps(cfg.kpl)
    groups = cfg.K // MOE_K_GROUP
    dual = cfg.stage == 1
    fp8 = cfg.a_format == "fp8"
    fnuz = cfg.arch == "gfx942"
    a_fx = common.fx_dtype(cfg.a_dtype) if not fp8 else None
    out_fx = common.fx_dtype(cfg.out_dtype) if cfg.stage == 1 else fx.Float32
    tiles, N = cfg.tiles, cfg.N
    scaled_mfma = fp8 and cfg.arch == "gfx950"

    def mma_atom():
        """The MFMA of this target and format, with the fragment element types (built while tracing)."""
        if scaled_mfma:
            return fx.make_mma_atom(cdna4.MFMA_Scale(16, 16, 128, fx.Float8E4M3FN, fx.Float4E2M1FN)), (
                fx.Float8E4M3FN, fx.Float4E2M1FN)
        if fp8:
            return fx.make_mma_atom(fx.rocdl.MFMA(16, 16, 32, fx.Float8E4M3FNUZ)), (
                fx.Float8E4M3FNUZ, fx.Float8E4M3FNUZ)
        return fx.make_mma_atom(fx.rocdl.MFMA(16, 16, 4 * kpl, fx.BFloat16)), (fx.BFloat16, fx.BFloat16)

    def frag(values, elem, n):
        t = fx.make_rmem_tensor(n, elem)
        t.store(values)
        return t

    @flyc.kernel
    def moe_gemm_kernel(
        A: fx.Tensor, AScale: fx.Tensor, Sorted: fx.Tensor, BlockExpert: fx.Tensor, Wq: fx.Tensor, Ws: fx.Tensor,
        Out: fx.Tensor, TopW: fx.Tensor, num_pairs: fx.Int32,
    ):
        tid = gpu.thread_idx.x
        lane = tid % 64
        wave = tid // 64
        block = gpu.block_idx.x
        e = fx.Int32(BlockExpert[block])
        m = mfma_ab_row(lane)
        # A row of this lane: the token of its pair (stage 1) or the block row itself (stage 2)
        pair = fx.Int32(Sorted[block * MOE_BLOCK_M + m])
        valid = pair < num_pairs
        if const_expr(cfg.stage == 1):
            a_row = valid.select(pair // cfg.top_k, 0)
        else:
            a_row = block * MOE_BLOCK_M + m
        if const_expr(fp8 and not scaled_mfma):
            # rows of the C fragment need their own A scales (scale applied after each step)
            c_rows = []
            for i in range_constexpr(4):
                r, _ = mfma_c_coord(lane, i)
                p_i = fx.Int32(Sorted[block * MOE_BLOCK_M + r])
                if const_expr(cfg.stage == 1):
                    c_rows.append((p_i < num_pairs).select(p_i // cfg.top_k, 0))
                else:
                    c_rows.append(block * MOE_BLOCK_M + r)

        tile0 = gpu.block_idx.y * (WAVES * tiles) + wave * tiles  # first 16-column tile of this wave
        b_tiles = []  # (tile index in the weight rows) per accumulator
        for t in range_constexpr(tiles):
            b_tiles.append(tile0 + t)
            if const_expr(dual):
                b_tiles.append(tile0 + t + N // 16)
        accs = [common.fill_rmem(4, 0.0) for _ in b_tiles]
        atom, (a_elem, b_elem) = mma_atom()

        for g in range(groups):
            # A operand: the lane's 32 K values of this group, dword-ordered like the weights
            if const_expr(fp8):
                a_bytes = []  # 4 dwords of 8 fp8 codes: two int32 each
                for d in range_constexpr(4):
                    k0 = moe_dword_k(lane, g, d, 0, layout)
                    for w in range_constexpr(2):
                        b4 = [fx.Int32(A[a_row, k0 + 4 * w + i]) & 255 for i in range_constexpr(4)]
                        a_bytes.append(b4[0] | (b4[1] << 8) | (b4[2] << 16) | (b4[3] << 24))
            else:
                a_vals = []
                for d in range_constexpr(4):
                    k0 = moe_dword_k(lane, g, d, 0, layout)
                    a_vals.append([A[a_row, k0 + p] for p in range_constexpr(8)])
            for ai in range_constexpr(len(b_tiles)):
                nt = b_tiles[ai]
                words = [fx.Int32(Wq[e, nt, g, lane, d]) for d in range_constexpr(4)]
                sdw = [fx.Int32(Ws[e, nt, g, m, b]) & 255 for b in range_constexpr(4)]
                acc = accs[ai]
                if const_expr(scaled_mfma):
                    a_frag = frag(fx.Vector.from_elements(a_bytes, fx.Int32).bitcast(a_elem), a_elem, 32)
                    b_frag = frag(fx.Vector.from_elements(words, fx.Int32).bitcast(b_elem), b_elem, 32)
                    sa = fx.Int32(AScale[a_row, g * 4 + moe_scale_slot(lane, 0, layout, kpl)]) & 255
                    call = atom.set_value("scale_a", sa).set_value(
                        "scale_b", _pick(sdw, moe_scale_slot(lane, 0, layout, kpl)))
                    fx.gemm(call, acc, a_frag, b_frag, acc)
                elif const_expr(fp8):
                    for s in range_constexpr(steps):  # step s = MX block s of the group
                        b8 = _fp4_to_fp8_words(words[s], fnuz)
                        a_frag = frag(fx.Vector.from_elements(a_bytes[2 * s : 2 * s + 2], fx.Int32).bitcast(a_elem),
                                      a_elem, 8)
                        b_frag = frag(fx.Vector.from_elements(b8, fx.Int32).bitcast(b_elem), b_elem, 8)
                        tmp = common.fill_rmem(4, 0.0)
                        fx.gemm(atom, tmp, a_frag, b_frag, tmp)
                        sb = _e8m0_to_f32(sdw[moe_scale_slot(lane, s, layout, kpl)])
                        blk = g * 4 + moe_scale_slot(lane, s, layout, kpl)  # the step's MX block
                        sc = [_e8m0_to_f32(fx.Int32(AScale[c_rows[i], blk]) & 255) * sb
                              for i in range_constexpr(4)]
                        acc.store(fx.memref_load_vec(acc) + fx.memref_load_vec(tmp) * fx.Vector.from_elements(
                            sc, fx.Float32))
                else:
                    for s in range_constexpr(steps):
                        d, p0 = moe_dword_pos(s, 0, layout, kpl)
                        slot = moe_scale_slot(lane, s, layout, kpl)
                        block_byte = sdw[slot] if layout == "step" else _pick(sdw, slot)
                        wv = _fp4_to_bf16(words[d], _e8m0_to_f32(block_byte), cfg.arch)
                        bv = fx.Vector.from_elements([wv[p0 + j] for j in range_constexpr(kpl)], fx.BFloat16)
                        av = fx.Vector.from_elements([a_vals[d][p0 + j] for j in range_constexpr(kpl)], a_fx)
                        fx.gemm(atom, acc, frag(av.to(fx.BFloat16), fx.BFloat16, kpl), frag(bv, fx.BFloat16, kpl), acc)

        # epilogue: C fragment element i of lane = (row (lane//16)*4 + i, column lane % 16) of each tile
        for t in range_constexpr(tiles):
            col = (tile0 + t) * 16 + lane % 16
            if const_expr(dual):
                gate = fx.memref_load_vec(accs[2 * t])
                up = fx.memref_load_vec(accs[2 * t + 1])
                for i in range_constexpr(4):
                    r, _ = mfma_c_coord(lane, i)
                    h = common.gated_activation(gate[i], up[i], cfg.activation)
                    Out[block * MOE_BLOCK_M + r, col] = h.to(out_fx)
            else:
                acc = fx.memref_load_vec(accs[t])
                for i in range_constexpr(4):
                    r, _ = mfma_c_coord(lane, i)
                    p_i = fx.Int32(Sorted[block * MOE_BLOCK_M + r])
                    if p_i < num_pairs:
                        Out[p_i, col] = acc[i] * fx.Float32(TopW[p_i])

    @flyc.jit
    def launch(
        A: fx.Tensor, AScale: fx.Tensor, Sorted: fx.Tensor, BlockExpert: fx.Tensor, Wq: fx.Tensor, Ws: fx.Tensor,
        Out: fx.Tensor, TopW: fx.Tensor, num_pairs: fx.Int32, num_blocks: fx.Int32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        moe_gemm_kernel(A, AScale, Sorted, BlockExpert, Wq, Ws, Out, TopW, num_pairs).launch(
            grid=(num_blocks, N // cfg.block_n), block=(WAVES * 64,), stream=stream
        )

    return launch
