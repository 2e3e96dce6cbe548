"""FlyDSL MLA prefill over the EXPANDED heads: the flash-attention kernel of long prompt chunks (K3_SPEC §3, NoPE +
output gate), twin of :mod:`rocm_k3.triton_kernels.mla_prefill_expanded`.

Compile-verified for gfx942 and gfx950 only (the ``compile`` test tier: no scratch, VGPR/LDS budgets, bf16 MFMA);
it has not been run on an AMD GPU: ``pytest -m rocm tests/kernels/flydsl/test_flydsl_rocm.py`` is its parity check.

Same algorithm as the Triton twin: the host (``mla_ops.mla_prefill``) walks a sequence's context in segments, expands
each segment's latents by one GEMM into ``KV [S, H, Dn + Dv]`` (``rocm_k3.ops.mla.expand_segment``) and launches
this kernel per segment. Each wave owns 16 query rows of one head (absolute positions ``q_pos0 + row``) and walks
the segment's keys up to the block's last query in blocks of BN keys with an online softmax
(fp32 max / sum / accumulators), the causal mask applied element-wise::

    s[j, l] = scale * (q_nope[j] . k_nope[l] + q_pe[j] . k_pe[l]),  l <= pos_j
    out[j]  = softmax_l(s[j]) @ v   (times sigmoid(gate[j]) when a gate is given, in fp32, one rounding)

Between segments the running (max, sum, acc) of every (query, head) lives in fp32 buffers ``ML [n, H, 2]`` and
``Acc [n, H, Dv]`` (``first`` / ``last`` are compile-time flags of the config, as FIRST / LAST in the Triton twin).

Tiling (``mla_prefill_plan``): 64 lanes, grid (ceil(n / 16), H). Both products run on bf16 (or fp16) MFMA,
transposed (S^T = K Q^T and O^T += V^T P^T) so the score C fragments are the B fragments of the PV product:
the probabilities go from fp32 registers to bf16 operands without LDS. The Q fragments (Dn + P = 192 values:
48 bf16 per lane) stay in registers for the whole walk; K, k_pe and V operands are read from global memory
(L2) per block. Differences from the Triton twin: 16 query rows per wave instead of 128 per 8-warp program, K/V
not staged in LDS (no reuse across waves), every block masked (the Triton twin skips the mask below the diagonal).
Performance is not measured (no AMD GPU).
"""

from __future__ import annotations

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.mla_prefill_plan import (
    ARCH_KPL,
    BM,
    TILE,
    WAVE,
    block_keys,
    out_col,
    pv_key,
    qk_a_key,
    qk_dim,
)

_NEG_BIG = -3.0e38  # the running max before any key (finite: exp of differences stays defined)


@dataclasses.dataclass(frozen=True)
class MlaPrefillConfig:
    """Static configuration of one expanded-prefill launcher: target arch (MFMA depth), heads, widths (Dn, P, Dv,
    latent R), activation dtype, gate dtype (None: no gate) and the segment flags."""

    arch: str
    num_heads: int
    nope: int = 128
    rope: int = 64
    v_dim: int = 128
    kv_lora_rank: int = 512
    dtype: str = "bf16"
    gate_dtype: str | None = None
    first: bool = True
    last: bool = True

    def __post_init__(self) -> None:
        if self.arch not in ARCH_KPL:
            raise ValueError(f"arch must be one of {tuple(ARCH_KPL)}, got {self.arch!r}")
        if self.dtype not in ("bf16", "f16"):
            raise ValueError(f"the MFMA operands are bf16 or f16, got {self.dtype!r}")
        if self.gate_dtype is not None:
            common.check_dtype(self.gate_dtype)
        step = 4 * self.kpl
        for name in ("nope", "rope"):
            value = getattr(self, name)
            if value < step or value % step:
                raise ValueError(f"{name}={value} must be a positive multiple of the MFMA depth {step} on {self.arch}")
        if self.v_dim < TILE or self.v_dim % TILE:
            raise ValueError(f"v_dim={self.v_dim} must be a positive multiple of {TILE}")
        if self.num_heads < 1 or self.kv_lora_rank < 1:
            raise ValueError(f"num_heads and kv_lora_rank must be >= 1, got {self.num_heads}, {self.kv_lora_rank}")

    @property
    def kpl(self) -> int:
        return ARCH_KPL[self.arch]

    @property
    def block_n(self) -> int:
        return block_keys(self.kpl)


def build_mla_prefill_expanded(config: MlaPrefillConfig):
    """``launch(Q, KV, Lat, Gate, Out, Acc, ML, q0, n_q, q_pos0, key0, seg_len, scale)``.

    Q [T, H, Dn + P] and Out [T, H, Dv] (activation dtype; rows ``q0 .. q0 + n_q`` are this sequence's); KV
    [S, H, Dn + Dv] the segment's expanded keys and values; Lat [S, R + P] its latents (k_pe = the last P columns);
    Gate [T, H, Dv] (read when ``gate_dtype``); Acc fp32 [n_q, H, Dv] and ML fp32 [n_q, H, 2] the state between
    segments (read unless ``first``, written unless ``last``). Keys ``0 .. seg_len`` of the segment sit at absolute
    positions ``key0 + l``; query row r at ``q_pos0 + r``. All contiguous.
    """
    H, nope, rope, vd, lora = config.num_heads, config.nope, config.rope, config.v_dim, config.kv_lora_rank
    kpl, bn = config.kpl, config.block_n
    s_tiles, v_tiles = bn // TILE, vd // TILE
    dn_steps, pe_steps = nope // (4 * kpl), rope // (4 * kpl)
    elem = common.fx_dtype(config.dtype)

    def frag(values):
        return common.rmem_of(values, elem)

    @flyc.kernel
    def mla_prefill_expanded_kernel(
        Q: fx.Tensor, KV: fx.Tensor, Lat: fx.Tensor, Gate: fx.Tensor, Out: fx.Tensor, Acc: fx.Tensor, ML: fx.Tensor,
        q0: fx.Int32, n_q: fx.Int32, q_pos0: fx.Int32, key0: fx.Int32, seg_len: fx.Int32, scale: fx.Float32,
    ):
        lane = gpu.thread_idx.x
        col = lane % TILE  # this lane's query row of the block (B operand / C column)
        h = gpu.block_idx.y
        m0 = gpu.block_idx.x * BM
        row = m0 + col
        row_c = fx.min(row, n_q - 1)  # rows past the chunk read the last row, store nothing
        t_q = q0 + row_c
        pos_q = q_pos0 + row
        atom = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, 4 * kpl, elem))

        # the query's nope and pe fragments (B operands of S^T = K Q^T), resident for the whole walk
        qn = [frag([Q[t_q, h, qk_dim(lane, s, j, kpl)] for j in range_constexpr(kpl)]) for s in range_constexpr(dn_steps)]
        qp = [frag([Q[t_q, h, nope + qk_dim(lane, s, j, kpl)] for j in range_constexpr(kpl)])
              for s in range_constexpr(pe_steps)]

        acc = []  # O^T tile vt, element i: value column out_col(lane, vt, i) of query `row`
        m_run = fx.Float32(_NEG_BIG)
        l_run = fx.Float32(0.0)
        if const_expr(config.first):
            for vt in range_constexpr(v_tiles):
                acc.append(common.fill_rmem(4, 0.0))
        else:
            m_run = fx.Float32(ML[row_c, h, 0])
            l_run = fx.Float32(ML[row_c, h, 1])
            for vt in range_constexpr(v_tiles):
                reg = fx.make_rmem_tensor(4, fx.Float32)
                reg.store(common.vector_of([fx.Float32(Acc[row_c, h, out_col(lane, vt, i)])
                                            for i in range_constexpr(4)], fx.Float32))
                acc.append(reg)

        # keys of this segment that the block's last query sees
        last_pos = q_pos0 + fx.min(m0 + BM, n_q) - 1
        hi = fx.min(seg_len, last_pos - key0 + 1)
        blocks = (fx.max(hi, 0) + (bn - 1)) // bn
        seg_last = seg_len - 1
        limit = fx.min(hi, pos_q - key0 + 1)  # keys (of the segment) this lane's query sees: l < limit
        for nb in range(blocks):
            n0 = nb * bn
            # S^T tiles: C element i of tile t = score of key n0 + s_key(lane, t, i) for this lane's query
            p_vals = []
            for t in range_constexpr(s_tiles):
                c = common.fill_rmem(4, 0.0)
                key_a = fx.min(n0 + qk_a_key(lane, t), seg_last)
                for s in range_constexpr(dn_steps):
                    a = frag([KV[key_a, h, qk_dim(lane, s, j, kpl)] for j in range_constexpr(kpl)])
                    fx.gemm(atom, c, a, qn[s], c)
                for s in range_constexpr(pe_steps):
                    a = frag([Lat[key_a, lora + qk_dim(lane, s, j, kpl)] for j in range_constexpr(kpl)])
                    fx.gemm(atom, c, a, qp[s], c)
                cv = fx.memref_load_vec(c)
                for i in range_constexpr(4):
                    key = n0 + pv_key(lane, 4 * t + i)
                    visible = key < limit
                    p_vals.append((visible, fx.Float32(cv[i] * scale)))
            # online softmax over the block (the 4 lane groups of a column hold the same query)
            bmax = fx.Float32(_NEG_BIG)
            for visible, s in p_vals:
                bmax = fx.max(bmax, fx.Float32(visible.select(s, _NEG_BIG)))
            bmax = fx.max(bmax, bmax.shuffle_xor(16, WAVE))
            bmax = fx.max(bmax, bmax.shuffle_xor(32, WAVE))
            m_new = fx.max(m_run, bmax)
            alpha = fmath.exp(m_run - m_new)
            probs = [fx.Float32(visible.select(fmath.exp(s - m_new), 0.0)) for visible, s in p_vals]
            psum = probs[0]
            for p in probs[1:]:
                psum = psum + p
            psum = psum + psum.shuffle_xor(16, WAVE)
            psum = psum + psum.shuffle_xor(32, WAVE)
            l_run = l_run * alpha + psum
            m_run = m_new
            # O^T += V^T P^T: one MFMA step of bn keys per value tile; B = this lane's probabilities (pv_key order)
            pb = frag([p.to(elem) for p in probs])
            v_keys = [fx.min(n0 + pv_key(lane, j), seg_last) for j in range_constexpr(kpl)]
            for vt in range_constexpr(v_tiles):
                ov = fx.memref_load_vec(acc[vt])
                acc[vt].store(common.vector_of([ov[i] * alpha for i in range_constexpr(4)], fx.Float32))
                a = frag([KV[v_keys[j], h, nope + vt * TILE + col] for j in range_constexpr(kpl)])
                fx.gemm(atom, acc[vt], a, pb, acc[vt])

        if row < n_q:
            if const_expr(config.last):
                inv = 1.0 / fx.Float32((l_run > 0.0).select(l_run, 1.0))
                for vt in range_constexpr(v_tiles):
                    ov = fx.memref_load_vec(acc[vt])
                    for i in range_constexpr(4):
                        d = out_col(lane, vt, i)
                        o = ov[i] * inv
                        if const_expr(config.gate_dtype is not None):
                            o = o * common.sigmoid(fx.Float32(Gate[t_q, h, d]))
                        Out[t_q, h, d] = o.to(elem)
            else:
                for vt in range_constexpr(v_tiles):
                    ov = fx.memref_load_vec(acc[vt])
                    for i in range_constexpr(4):
                        Acc[row, h, out_col(lane, vt, i)] = ov[i]
                if lane < TILE:
                    ML[row, h, 0] = m_run
                    ML[row, h, 1] = l_run

    @flyc.jit
    def launch(
        Q: fx.Tensor, KV: fx.Tensor, Lat: fx.Tensor, Gate: fx.Tensor, Out: fx.Tensor, Acc: fx.Tensor, ML: fx.Tensor,
        q0: fx.Int32, n_q: fx.Int32, q_pos0: fx.Int32, key0: fx.Int32, seg_len: fx.Int32, scale: fx.Float32,
        stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        mla_prefill_expanded_kernel(Q, KV, Lat, Gate, Out, Acc, ML, q0, n_q, q_pos0, key0, seg_len,
                                    scale).launch(grid=((n_q + BM - 1) // BM, H), block=(WAVE,), stream=stream)

    return launch
