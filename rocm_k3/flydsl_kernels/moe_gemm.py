"""FlyDSL MXFP4 MoE GEMMs (stage 1: w13 + SiTU, stage 2: w2 + routing weight), compile-verified only.

Not yet run on an AMD GPU: these kernels compile for gfx942 and gfx950 (ISA budgets in the compile tier) and
their index maps, bit formulas and tile schedules are tested on the host (``plans``/``weights``/``bitcodes``).

Rows are (token, slot) pairs sorted by expert and padded to blocks of 16 (``moe_align``); a workgroup takes
one 16-row block (one expert) and 4 waves x ``tiles`` 16-column MFMA tiles; the K loop runs over groups of
128 (4 MX blocks), each lane reading one 16-byte vector of pre-shuffled FP4 codes per tile and group
(``weights``) and one scale dword. The loads of group g + ``prefetch`` are issued before group g is computed
(a ring of ``prefetch`` register buffers: weights, scales and activations), so each wave keeps
``prefetch`` groups of HBM reads in flight. Stage 2 can split K (``split_k``): split s writes its partial
sums to rows ``s * num_pairs + pair`` of Out and ``moe_reduce`` adds the splits (deterministic).

- stage 1: A = x rows gathered by token (``pair // top_k``), B = w13 gate rows n and up rows N + n;
  epilogue h = act(gate, up) (SiTU or SiLU, fp32) written to H [P, N].
- stage 2: A = H rows (the block rows themselves), B = w2; epilogue topk_weight[pair] * acc written to
  Y [T*top_k, Kout] at the pair's row (padding rows skipped); ``moe_reduce`` sums the top-k rows.

Per target and activation format (``a_format``):
- "bf16" (A16W4), gfx942: FP4 codes are decoded UNSCALED to bf16 by the byte lookup of
  ``bitcodes.e2m1x8_to_bf16_pairs`` (4 ``v_perm_b32`` on two constant byte pools + sign bits + 4 interleaving
  perms: 14 VALU per 8 weights; the "step" layout stores the nibbles in the order the pairs come out, so they are
  the ``v_mfma_f32_16x16x16_bf16`` B fragments as decoded). The two MFMA steps of an MX block run into a zeroed
  temporary and the block's scale is applied once on the accumulator, ``acc += tmp * 2^(s - 127)``: exact,
  because a "step" MFMA never mixes MX blocks and every C value of a lane belongs to its one weight column.
- "bf16" (A16W4), gfx950: ``v_cvt_scalef32_pk_bf16_fp4`` decodes two codes with the scale folded, then
  ``v_mfma_f32_16x16x32_bf16`` (8 K per lane, 4 steps per group).
- "fp8" (A8W4), gfx942: A is MXFP8 in FNUZ e4m3 (``mxfp8_quant``), FP4 codes map exactly to FNUZ e4m3
  bytes by one ``v_perm_b32`` per 4 codes (``bitcodes.e2m1x8_to_fnuz_words``: 12 VALU per 8 weights, -0 kept
  off NaN), one ``v_mfma_f32_16x16x32_fp8_fp8`` per MX block ("step" layout: a step never mixes MX blocks),
  and the fp32 result of each step is scaled by 2^(sa + sb - 254) per (row, column) before accumulation (the
  activation scales of a group are read once for all tiles).
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
    moe_k_index,
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
    activation: ("situ", beta, linear_beta or None) | ("silu", 0, None); tiles: 16-column tiles per wave;
    prefetch: K groups loaded ahead (1..3; lowered to the largest divisor of K/128 it does not exceed);
    split_k: stage 2 only, K splits (a divisor of K/128), one per grid z index.
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
    prefetch: int = 2
    split_k: int = 1

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
        if not 1 <= self.prefetch <= 3:
            raise ValueError(f"prefetch must be 1, 2 or 3 K groups, got {self.prefetch}")
        groups = self.K // MOE_K_GROUP
        if self.split_k < 1 or groups % self.split_k or (self.stage == 1 and self.split_k != 1):
            raise ValueError(f"split_k={self.split_k} must divide K/128={groups} (and be 1 for stage 1)")

    @property
    def ring(self) -> int:
        """Prefetch depth actually used: the largest d <= prefetch dividing the groups of one split."""
        per_split = self.K // MOE_K_GROUP // self.split_k
        return max(d for d in range(1, self.prefetch + 1) if per_split % d == 0)

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


def _e8m0_scale(byte):
    """2^(byte - 127) as fp32 from an int32 holding the byte: one shift and one max (bitcodes)."""
    return bitcodes.e8m0_to_f32_bits_by_max(byte, fx.max).bitcast(fx.Float32)


def _fp4_to_bf16(word, scale):
    """gfx950: 8 E2M1 codes of an int32 (low nibble first) -> 8 bf16 values times ``scale`` (exact), two codes per
    ``v_cvt_scalef32_pk_bf16_fp4``. (gfx942 has no FP4 conversion: it uses ``bitcodes.e2m1x8_to_bf16_pairs``.)"""
    pairs = [fx.Vector(fx.rocdl.cvt_scalef32_pk_bf16_fp4(T.vec(2, T.bf16), word, scale, sel))
             for sel in range_constexpr(4)]
    return fx.Vector.from_elements([pr[j] for pr in pairs for j in range_constexpr(2)], fx.BFloat16)


def _pick(values, index):
    """values[index] for a runtime index in 0..3 (a select chain)."""
    return (index == 0).select(values[0], (index == 1).select(values[1], (index == 2).select(values[2], values[3])))


def _perm(src_hi, src_lo, sel):
    """``v_perm_b32`` (byte select from the pool ``src_hi:src_lo``) on DSL i32 values or int constants."""
    return fx.Int32(fx.rocdl.perm_b32(*[fx.Int32(v) if isinstance(v, int) else v for v in (src_hi, src_lo, sel)]))


def build_moe_gemm(cfg: MoeGemmConfig):
    """``launch(A, AScale, Sorted, BlockExpert, Wq, Ws, Out, TopW, num_pairs, num_blocks)``.

    A: stage 1 x [T, K] (bf16) or x codes [T, K] uint8 (fp8); stage 2 H [P, K] or its codes [P, K] uint8.
    AScale: uint8 [rows, K/32] E8M0 scales of an fp8 A (any tensor for bf16). Sorted int32 [P] pair ids
    (>= num_pairs marks padding), BlockExpert int32 [P/16]. Wq int32 [E, R/16, K/128, 64, 4] and Ws uint8
    [E, R/16, K/128, 16, 4] (``weights.preshuffle_codes``). Out: stage 1 H [P, N]; stage 2 Y fp32
    [split_k * num_pairs, N] (split s at rows s * num_pairs + pair). TopW fp32 [num_pairs] (stage 2 only).
    """
    layout, kpl, steps = cfg.layout, cfg.kpl, moe_steps(cfg.kpl)
    groups = cfg.K // MOE_K_GROUP // cfg.split_k  # K groups of one split
    ring = cfg.ring
    dual = cfg.stage == 1
    fp8 = cfg.a_format == "fp8"
    a_fx = common.fx_dtype(cfg.a_dtype) if not fp8 else None
    out_fx = common.fx_dtype(cfg.out_dtype) if cfg.stage == 1 else fx.Float32
    tiles, N = cfg.tiles, cfg.N
    scaled_mfma = fp8 and cfg.arch == "gfx950"
    lut_decode = not fp8 and cfg.arch == "gfx942"  # unscaled byte-lookup decode, scale on the accumulator

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
        split = gpu.block_idx.z
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

        # prefetch ring: slot r holds group g0 + r of the lane's activations, weight dwords and scale bytes
        a_buf = [fx.make_rmem_tensor(8, fx.Int32) if fp8 else fx.make_rmem_tensor(32, a_fx)
                 for _ in range_constexpr(ring)]
        w_buf = [[fx.make_rmem_tensor(4, fx.Int32) for _ in b_tiles] for _ in range_constexpr(ring)]
        s_buf = [[fx.make_rmem_tensor(4, fx.Int32) for _ in b_tiles] for _ in range_constexpr(ring)]

        def a_k(g, d, o):
            """K of the lane's activation value o (0..7) of MX-block dword d in group g (fragment order)."""
            if const_expr(lut_decode):
                return moe_k_index(lane, g, 2 * d + o // 4, o % 4, layout, kpl)
            if const_expr(fp8 and not scaled_mfma):
                return moe_k_index(lane, g, d, o, layout, kpl)  # decode order of the FNUZ bytes
            return moe_dword_k(lane, g, d, o, layout)

        def fetch(g, r):
            if const_expr(fp8):
                a_bytes = []  # 4 dwords of 8 fp8 codes: two int32 each
                for d in range_constexpr(4):
                    for w in range_constexpr(2):
                        b4 = [fx.Int32(A[a_row, a_k(g, d, 4 * w + i)]) & 255 for i in range_constexpr(4)]
                        a_bytes.append(b4[0] | (b4[1] << 8) | (b4[2] << 16) | (b4[3] << 24))
                a_buf[r].store(fx.Vector.from_elements(a_bytes, fx.Int32))
            else:
                a_buf[r].store(fx.Vector.from_elements(
                    [A[a_row, a_k(g, d, o)] for d in range_constexpr(4) for o in range_constexpr(8)], a_fx))
            for ai in range_constexpr(len(b_tiles)):
                nt = b_tiles[ai]
                w_buf[r][ai].store(fx.Vector.from_elements([fx.Int32(Wq[e, nt, g, lane, d])
                                                            for d in range_constexpr(4)], fx.Int32))
                s_buf[r][ai].store(fx.Vector.from_elements([fx.Int32(Ws[e, nt, g, m, b]) & 255
                                                            for b in range_constexpr(4)], fx.Int32))

        g_begin = split * groups
        g_last = g_begin + groups - 1
        for r in range_constexpr(ring):
            fetch(g_begin + r, r)
        for g0 in range(g_begin, g_begin + groups, ring):
            for r in range_constexpr(ring):
                g = g0 + r
                a_in = fx.memref_load_vec(a_buf[r])
                w_in = [fx.memref_load_vec(w_buf[r][ai]) for ai in range_constexpr(len(b_tiles))]
                s_in = [fx.memref_load_vec(s_buf[r][ai]) for ai in range_constexpr(len(b_tiles))]
                fetch(fx.min(fx.Int32(g + ring), fx.Int32(g_last)), r)  # the loads of group g + ring go out now
                if const_expr(fp8):
                    a_bytes = [a_in[i] for i in range_constexpr(8)]
                if const_expr(fp8 and not scaled_mfma):  # activation scales of the C rows, per MX block
                    a_sc = [[_e8m0_scale(fx.Int32(AScale[c_rows[i], g * 4 + s]) & 255) for i in range_constexpr(4)]
                            for s in range_constexpr(steps)]
                if const_expr(not fp8):
                    a_vals = [[a_in[8 * d + o] for o in range_constexpr(8)] for d in range_constexpr(4)]
                for ai in range_constexpr(len(b_tiles)):
                    words = [w_in[ai][d] for d in range_constexpr(4)]
                    sdw = [s_in[ai][b] for b in range_constexpr(4)]
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
                            b8 = list(bitcodes.e2m1x8_to_fnuz_words(words[s], _perm))
                            a_frag = frag(fx.Vector.from_elements(a_bytes[2 * s : 2 * s + 2], fx.Int32).bitcast(
                                a_elem), a_elem, 8)
                            b_frag = frag(fx.Vector.from_elements(b8, fx.Int32).bitcast(b_elem), b_elem, 8)
                            tmp = common.fill_rmem(4, 0.0)
                            fx.gemm(atom, tmp, a_frag, b_frag, tmp)
                            sb = _e8m0_scale(sdw[s])
                            acc.store(fx.math.fma(fx.memref_load_vec(tmp), fx.Vector.from_elements(
                                [a_sc[s][i] * sb for i in range_constexpr(4)], fx.Float32), fx.memref_load_vec(acc)))
                    elif const_expr(lut_decode):
                        for d in range_constexpr(4):  # MX block d: two MFMA steps, then its scale once
                            e0, e1, o0, o1 = bitcodes.e2m1x8_to_bf16_pairs(words[d], _perm)
                            tmp = common.fill_rmem(4, 0.0)
                            for sub in range_constexpr(2):
                                pair_words = [e0, o0] if sub == 0 else [e1, o1]  # K offsets 4 sub .. 4 sub + 3
                                bv = fx.Vector.from_elements(pair_words, fx.Int32).bitcast(fx.BFloat16)
                                av = fx.Vector.from_elements([a_vals[d][4 * sub + j] for j in range_constexpr(4)],
                                                             a_fx)
                                fx.gemm(atom, tmp, frag(av.to(fx.BFloat16), fx.BFloat16, 4),
                                        frag(bv, fx.BFloat16, 4), tmp)
                            scale = _e8m0_scale(sdw[d])
                            acc.store(fx.math.fma(fx.memref_load_vec(tmp), fx.Vector.from_elements(
                                [scale, scale, scale, scale], fx.Float32), fx.memref_load_vec(acc)))
                    else:
                        for s in range_constexpr(steps):
                            d, p0 = moe_dword_pos(s, 0, layout, kpl)
                            slot = moe_scale_slot(lane, s, layout, kpl)
                            wv = _fp4_to_bf16(words[d], _e8m0_scale(_pick(sdw, slot)))
                            bv = fx.Vector.from_elements([wv[p0 + j] for j in range_constexpr(kpl)], fx.BFloat16)
                            av = fx.Vector.from_elements([a_vals[d][p0 + j] for j in range_constexpr(kpl)], a_fx)
                            fx.gemm(atom, acc, frag(av.to(fx.BFloat16), fx.BFloat16, kpl), frag(bv, fx.BFloat16, kpl),
                                    acc)

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
                        Out[split * num_pairs + p_i, col] = acc[i] * fx.Float32(TopW[p_i])

    @flyc.jit
    def launch(
        A: fx.Tensor, AScale: fx.Tensor, Sorted: fx.Tensor, BlockExpert: fx.Tensor, Wq: fx.Tensor, Ws: fx.Tensor,
        Out: fx.Tensor, TopW: fx.Tensor, num_pairs: fx.Int32, num_blocks: fx.Int32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        moe_gemm_kernel(A, AScale, Sorted, BlockExpert, Wq, Ws, Out, TopW, num_pairs).launch(
            grid=(num_blocks, N // cfg.block_n, cfg.split_k), block=(WAVES * 64,), stream=stream
        )

    return launch
