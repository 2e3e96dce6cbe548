"""FlyDSL fused KDA decode step (compile-verified for gfx942/gfx950; not yet run on an AMD GPU).

One token per sequence through a KDA layer up to o_proj (op ``kda_decode``, K3_SPEC section 2), fused:
    window = (conv_state[slot, c, :], qkv[n, c]);  mixed_c = silu(<conv_w[c], window>);  conv_state <- window[1:]
    q, k, v = split(mixed);  g = kda_gate(f);  beta = sigmoid(b)
    q = q / sqrt(|q|^2 + 1e-6) * scale;  k = k / sqrt(|k|^2 + 1e-6)
    S = diag(exp(g)) S;  u = v - S^T k;  S = S + beta k u^T;  o = S^T q          (S [K, V] fp32, in place)
    y = o * rsqrt(mean(o^2) + eps) * w_norm * sigmoid(out_gate)

Tiling: one workgroup of 2K = 256 lanes (four waves) per (sequence, head); grid (N, H). The lane pair
(2c, 2c+1) owns key channel c (the three depthwise convs of q/k/v channel c and the gate g_c, computed
by both, stored by the even lane) and value column c of the state, split by rows: each lane loads its
64 rows of S[slot, h, :, c] into registers once (a wave reads 32 consecutive columns of a row per
access), decays them, takes its half of the dot with k (the halves meet with one xor shuffle), applies
the rank-1 update, takes its half of the dot with q and writes the rows back: the state is read once
and written once, which is the whole cost of decode (64 KiB per head). q, k and exp(g) are shared through LDS (3 x 512 B, broadcast reads); the two L2
norms and the output RMSNorm are two-wave reductions through LDS. The conv output stays fp32 (it is
not rounded to the activation dtype), like the reference.

Mapping to the Triton twin (``triton_kernels/kda/decode.py``): the same single fused kernel, one program
per (sequence, head), state slots addressed by index in place, the same order of operations and fp32
math; here the [K, V] tile is split by value column over lane pairs, so the two reductions over K are
64 FMAs inside a lane plus one xor shuffle.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr import math as fmath

from rocm_k3.flydsl_kernels import common
from rocm_k3.flydsl_kernels.plans import KDA_HEAD_DIMS, KDA_LANES_PER_COLUMN, kda_decode_row


@dataclasses.dataclass(frozen=True)
class KdaDecodeConfig:
    """Static configuration: heads H, head dim K (= V), conv width W, dtypes, gate variant."""

    num_heads: int
    head_dim: int = 128
    conv_width: int = 4
    dtype: str = "bf16"
    lower_bound: float | None = -5.0

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.head_dim not in KDA_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {KDA_HEAD_DIMS}, got {self.head_dim}")
        if self.conv_width < 2:
            raise ValueError(f"conv_width must be >= 2, got {self.conv_width}")
        common.check_dtype(self.dtype)


def token_scratch_struct(K: int):
    """The LDS scratch of one token in the KDA decode and recurrent prefill kernels, fp32: the normalised q, k and
    exp(g) [K] and the block-reduction scratch [8] (built at kernel build time)."""

    @fx.struct
    class Shared:
        q: fx.Array[fx.Float32, K, 16]
        k: fx.Array[fx.Float32, K, 16]
        eg: fx.Array[fx.Float32, K, 16]
        red: fx.Array[fx.Float32, 8, 16]

    return Shared


def token_scratch_views(shared, K: int):
    """(q, k, exp(g), reduction) views of a workgroup's :func:`token_scratch_struct` allocation (in a kernel)."""
    lds = fx.SharedAllocator().allocate(shared).peek()
    return tuple(getattr(lds, name).view(fx.make_layout(size, 1)) for name, size in
                 (("q", K), ("k", K), ("eg", K), ("red", 8)))


def build_kda_decode(config: KdaDecodeConfig):
    """``launch(qkv, f, beta, out_gate, conv_w, conv_state, A_log, dt_bias, o_norm_w, state, slots, y, N, scale, eps)``.

    Shapes as in ``rocm_k3.ops.kda.kda_decode``; ``y`` [N, H*K] is written, ``conv_state`` and ``state``
    are updated in place at ``slots``.
    """
    H, K, W = config.num_heads, config.head_dim, config.conv_width
    lanes = KDA_LANES_PER_COLUMN * K
    waves = lanes // common.WAVE
    rows = K // KDA_LANES_PER_COLUMN
    act = common.fx_dtype(config.dtype)
    lower = config.lower_bound

    Shared = token_scratch_struct(K)

    @flyc.kernel
    def kda_decode_kernel(
        QKV: fx.Tensor, F: fx.Tensor, Beta: fx.Tensor, OutGate: fx.Tensor, ConvW: fx.Tensor, ConvState: fx.Tensor,
        ALog: fx.Tensor, DtBias: fx.Tensor, ONormW: fx.Tensor, State: fx.Tensor, Slots: fx.Tensor, Y: fx.Tensor,
        scale: fx.Float32, eps: fx.Float32,
    ):
        tid, c, half, lead, n, h = common.kda_lane()
        slot = fx.Int32(Slots[n])
        sq, sk, seg, red = token_scratch_views(Shared, K)

        # short conv update + SiLU of channel c of q, k and v (the conv state keeps the last W-1 inputs)
        mixed = []
        for part in range_constexpr(3):
            ch = part * H * K + h * K + c
            x_new = fx.Float32(QKV[n, ch])
            hist = [fx.Float32(ConvState[slot, ch, j]) for j in range(W - 1)]
            acc = fx.Float32(ConvW[ch, W - 1]) * x_new
            for j in range_constexpr(W - 1):
                acc = acc + fx.Float32(ConvW[ch, j]) * hist[j]
            if lead:
                for j in range_constexpr(W - 2):
                    ConvState[slot, ch, j] = hist[j + 1].to(ConvState.element_type)
                ConvState[slot, ch, W - 2] = x_new.to(ConvState.element_type)
            mixed.append(common.silu(acc))
        q, k, v = mixed

        # gate (log decay) of key channel c
        a = fmath.exp(fx.Float32(ALog[h]))
        g = common.kda_log_decay("softplus" if lower is None else "safe", fx.Float32(F[n, h * K + c]), a,
                                 fx.Float32(DtBias[h * K + c]), lower)
        beta = common.sigmoid(fx.Float32(Beta[n, h]))

        # L2 norms of q and k over the K channels (each channel counted once, by its even lane)
        qq, kk = common.block_sum2(lead.select(q * q, 0.0), lead.select(k * k, 0.0), red, tid, waves)
        sq[c] = q * fmath.rsqrt(qq + 1e-6) * scale
        sk[c] = k * fmath.rsqrt(kk + 1e-6)
        seg[c] = fmath.exp(g)
        gpu.barrier()

        # recurrence on value column c: S[:, c] in registers. The [K, V] tile of (slot, h) gets one buffer
        # descriptor; row r of column c is at element r*V + c (uniform part r*V, lane part c).
        tile = common.flat_vectors(common.static_view(fx.slice(State, (slot, h, None, None)), K * K), 1)
        f32 = common.copy_atom("f32", 1)
        col = []
        dot = fx.Float32(0.0)
        for i in range_constexpr(rows):
            r = kda_decode_row(half, i, K)
            s_r = common.load_vec(f32, tile, r * K + c, 1, "f32")[0] * seg[r]
            col.append(s_r)
            dot = dot + s_r * sk[r]
        dot = dot + dot.shuffle_xor(1, common.WAVE)  # the other half of column c
        u = (v - dot) * beta
        o = fx.Float32(0.0)
        for i in range_constexpr(rows):
            r = kda_decode_row(half, i, K)
            s_r = col[i] + sk[r] * u
            common.store_vec(f32, tile, r * K + c, fx.Vector.filled(1, s_r, fx.Float32), 1, "f32")
            o = o + s_r * sq[r]
        o = o + o.shuffle_xor(1, common.WAVE)

        # gated RMSNorm over the V columns
        oo = common.block_sum(lead.select(o * o, 0.0), red, tid, waves)
        y = o * fmath.rsqrt(oo / float(K) + eps) * fx.Float32(ONormW[c]) * common.sigmoid(
            fx.Float32(OutGate[n, h * K + c])
        )
        if lead:
            Y[n, h * K + c] = y.to(act)

    @flyc.jit
    def launch(
        QKV: fx.Tensor, F: fx.Tensor, Beta: fx.Tensor, OutGate: fx.Tensor, ConvW: fx.Tensor, ConvState: fx.Tensor,
        ALog: fx.Tensor, DtBias: fx.Tensor, ONormW: fx.Tensor, State: fx.Tensor, Slots: fx.Tensor, Y: fx.Tensor,
        num_seqs: fx.Int32, scale: fx.Float32, eps: fx.Float32, stream: fx.Stream = common.DEFAULT_STREAM,
    ):
        kda_decode_kernel(
            QKV, F, Beta, OutGate, ConvW, ConvState, ALog, DtBias, ONormW, State, Slots, Y, scale, eps
        ).launch(grid=(num_seqs, H), block=(lanes,), stream=stream)

    return launch
