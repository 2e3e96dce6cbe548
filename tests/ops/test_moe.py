"""MoE ops: SiTU/SiLU at hand-computed points, the router against a python loop, fused_moe against a
per-token per-expert loop that decodes the MXFP4 bytes itself (fp64), and the boundary errors."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_rel, seeded

from rocm_k3.ops import moe, moe_reference, quant
from rocm_k3.ops.registry import BackendError

# ---------------------------------------------------------------- activations


def situ_py(g: float, u: float, beta: float = 4.0, lb: float | None = 25.0) -> float:
    up = u if lb is None else lb * math.tanh(u / lb)
    return beta * math.tanh(g / beta) / (1.0 + math.exp(-g)) * up


def test_situ_known_points():
    x = torch.tensor([[0.0, 5.0, 40.0, -3.0, 7.0, 1.0, -2.0, 0.0]])  # gate | up
    out = moe.situ_and_mul(x)
    assert out[0, 0].item() == 0.0  # g = 0: tanh(0) = 0
    # g = 5, u = 1: 4 tanh(1.25) sigmoid(5) * 25 tanh(0.04)
    assert out[0, 1].item() == pytest.approx(4 * math.tanh(1.25) / (1 + math.exp(-5)) * 25 * math.tanh(0.04), rel=1e-6)
    # large g: 4 tanh(10) sigmoid(40) -> 4 (to 1e-8), so out ~ 4 * 25 tanh(u / 25)
    assert out[0, 2].item() == pytest.approx(4 * 25 * math.tanh(-2 / 25), rel=1e-6)
    assert out[0, 3].item() == 0.0  # u = 0


@pytest.mark.parametrize("linear_beta", [25.0, None], ids=["lb25", "lbNone"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)], ids=["fp32", "bf16"])
def test_situ_and_mul_matches_python_math(linear_beta, dtype, tol):
    x = (torch.randn(5, 2, 64, generator=seeded(20)) * 6).to(dtype)
    out = moe.situ_and_mul(x, 4.0, linear_beta)
    assert out.shape == (5, 2, 32) and out.dtype == dtype
    xs = x.double().tolist()
    expected = torch.tensor(
        [[[situ_py(row[i], row[32 + i], 4.0, linear_beta) for i in range(32)] for row in plane] for plane in xs],
        dtype=torch.float64,
    )
    assert_rel(out, expected, tol, "situ_and_mul")


def test_silu_and_mul_matches_python_math():
    x = torch.randn(9, 96, generator=seeded(21)) * 4
    out = moe.silu_and_mul(x)
    expected = torch.tensor(
        [[r[i] / (1 + math.exp(-r[i])) * r[48 + i] for i in range(48)] for r in x.double().tolist()]
    )
    assert_rel(out, expected, 1e-6, "silu_and_mul")


def test_activation_config_is_validated():
    assert moe.MoEActivation() == moe.MoEActivation("situ", 4.0, 25.0)
    with pytest.raises(ValueError, match="kind"):
        moe.MoEActivation("gelu")
    with pytest.raises(ValueError, match="beta"):
        moe.MoEActivation("situ", beta=0.0)
    with pytest.raises(ValueError, match="linear_beta"):
        moe.MoEActivation("situ", linear_beta=-1.0)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2N\]"):
        moe.situ_and_mul(torch.zeros(3, 7))


# ---------------------------------------------------------------- router


def route_py(logits, k, bias=None, renormalize=True, scale=1.0):
    """Per-token loop in python floats: ties in s + bias go to the lower expert index."""
    weights, ids = [], []
    for row in logits.double().tolist():
        s = [1.0 / (1.0 + math.exp(-v)) for v in row]
        b = [0.0] * len(row) if bias is None else bias.double().tolist()
        chosen = sorted(range(len(row)), key=lambda e: (-(s[e] + b[e]), e))[:k]
        w = [s[e] for e in chosen]
        total = sum(w)
        weights.append([(wi / total if renormalize else wi) * scale for wi in w])
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), ids


@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "renormalize, scale", [(True, 1.0), (False, 1.0), (True, 2.446)], ids=["renorm", "raw", "renorm-x2.446"]
)
@pytest.mark.parametrize("top_k", [1, 4])
def test_route_matches_python_loop(use_bias, renormalize, scale, top_k):
    gen = seeded(30)
    logits = torch.randn(9, 16, generator=gen) * 2
    bias = torch.randn(16, generator=gen) * 0.3 if use_bias else None
    result = moe.route(logits, top_k, correction_bias=bias, renormalize=renormalize, scaling_factor=scale)
    weights, ids = route_py(logits, top_k, bias, renormalize, scale)
    assert result.ids.dtype == torch.int32 and result.weights.dtype == torch.float32
    assert result.ids.tolist() == ids
    assert_rel(result.weights, weights, 1e-6, "route weights")


def test_route_ties_go_to_lower_index():
    gen = seeded(31)
    logits = torch.randint(-1, 2, (12, 16), generator=gen).float()  # values in {-1, 0, 1}: many exact ties
    bias = torch.randint(0, 2, (16,), generator=gen).float() * 0.25
    for b in (None, bias):
        result = moe.route(logits, 4, correction_bias=b)
        weights, ids = route_py(logits, 4, b)
        assert result.ids.tolist() == ids
        assert_rel(result.weights, weights, 1e-6, "route weights")


def test_route_bias_only_selects():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    result = moe.route(logits, 2, correction_bias=torch.tensor([0.0, 0.0, 0.0, 10.0]), renormalize=False)
    assert result.ids.tolist() == [[3, 0]]  # expert 3 only wins through its bias
    sig = [1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-2.0))]
    assert result.weights[0].tolist() == pytest.approx(sig, rel=1e-6)  # weights are sigmoid(logit), no bias


def test_route_validation():
    with pytest.raises(TypeError, match="router_logits must have dtype torch.float32"):
        moe.route(torch.zeros(2, 8, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="top_k"):
        moe.route(torch.zeros(2, 8), 9)
    with pytest.raises(ValueError, match="top_k"):
        moe.route(torch.zeros(2, 8), 0)
    with pytest.raises(ValueError, match=r"correction_bias must have shape \[E\]"):
        moe.route(torch.zeros(2, 8), 2, correction_bias=torch.zeros(7))
    with pytest.raises(ValueError, match="router_logits must have 2 dims"):
        moe.route(torch.zeros(8), 2)


# ---------------------------------------------------------------- fused_moe


def decode_mxfp4_f64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp64 [R, K]: E2M1 from its bit fields (sign, 2-bit exponent bias 1, 1-bit mantissa) times 2^(s - 127)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()  # [R, K]
    sign = torch.where(codes & 8 > 0, -1.0, 1.0).double()
    exp, man = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(exp == 0, man * 0.5, torch.pow(2.0, (exp - 1).double()) * (1 + man / 2))
    return sign * mag * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=1)


def act_f64(h: torch.Tensor, activation: moe.MoEActivation) -> torch.Tensor:
    n = h.shape[-1] // 2
    g, u = h[..., :n], h[..., n:]
    if activation.kind == "silu":
        return g * torch.sigmoid(g) * u
    up = u if activation.linear_beta is None else activation.linear_beta * torch.tanh(u / activation.linear_beta)
    return activation.beta * torch.tanh(g / activation.beta) * torch.sigmoid(g) * up


def mxfp8_round_trip(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    q, s = quant.quantize_mxfp8(v.float(), fp8_dtype)  # quantiser verified in test_quant.py
    return quant.dequantize_mxfp8(q, s, torch.float64)


def fused_moe_loop(x, weights: moe.ExpertWeights, topk_weights, topk_ids, activation, fp8_dtype=None):
    """One token and one chosen expert at a time, decoding that expert's weights for every (token, expert) pair."""
    out = torch.zeros(x.shape[0], weights.out_features, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t : t + 1].double()  # [1, K]
        if fp8_dtype is not None:
            xt = mxfp8_round_trip(xt, fp8_dtype)
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if weights.fmt == "mxfp4":
                w13 = decode_mxfp4_f64(weights.w13[e], weights.w13_scale[e])  # [2N, K]
                w2 = decode_mxfp4_f64(weights.w2[e], weights.w2_scale[e])  # [Kout, N]
            else:
                w13, w2 = weights.w13[e].double(), weights.w2[e].double()
            a = act_f64(xt @ w13.T, activation)  # [1, N]
            if fp8_dtype is not None:
                a = mxfp8_round_trip(a, fp8_dtype)
            out[t] += float(topk_weights[t, j]) * (a @ w2.T)[0]
    return out


def make_experts(fmt: str, e: int, k: int, n: int, k_out: int, seed: int) -> moe.ExpertWeights:
    gen = seeded(seed)
    w13 = torch.randn(e, 2 * n, k, generator=gen) / math.sqrt(k)
    w2 = torch.randn(e, k_out, n, generator=gen) / math.sqrt(n)
    if fmt == "bf16":
        return moe.ExpertWeights("bf16", w13.bfloat16(), None, w2.bfloat16(), None)
    return moe.ExpertWeights("mxfp4", *quant.quantize_mxfp4(w13), *quant.quantize_mxfp4(w2))


def make_routing(t: int, e: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = seeded(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)]).to(torch.int32)  # [T, k]
    w = torch.rand(t, top_k, generator=gen) + 0.1
    return w / w.sum(-1, keepdim=True), ids


SHAPES = [  # T, E, top_k, K, N, Kout
    pytest.param((1, 8, 2, 64, 64, 64), id="T1-E8-k2-K64-N64"),
    pytest.param((7, 16, 4, 128, 96, 128), id="T7-E16-k4-K128-N96"),
    pytest.param((33, 8, 4, 256, 64, 96), id="T33-E8-k4-K256-N64-Kout96"),
    pytest.param((33, 16, 2, 64, 128, 64), id="T33-E16-k2-K64-N128"),
]
MODES = [  # expert format, act_quant, fp8 dtype
    pytest.param(("mxfp4", "bf16", None), id="A16W4"),
    pytest.param(("mxfp4", "mxfp8", torch.float8_e4m3fn), id="A8W4-ocp"),
    pytest.param(("mxfp4", "mxfp8", torch.float8_e4m3fnuz), id="A8W4-fnuz"),
    pytest.param(("bf16", "bf16", None), id="bf16-experts"),
]
BF16_OUT_TOL = 4e-3  # one bf16 rounding of the output (2^-9 relative) plus fp32 accumulation


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_per_token_loop(shape, mode):
    t, e, top_k, k, n, k_out = shape
    fmt, act_quant, fp8_dtype = mode
    weights = make_experts(fmt, e, k, n, k_out, seed=40)
    topk_weights, topk_ids = make_routing(t, e, top_k, seed=41)
    x = torch.randn(t, k, generator=seeded(42)).bfloat16()
    out = moe.fused_moe(x, weights, topk_weights, topk_ids, act_quant=act_quant, fp8_dtype=fp8_dtype)
    assert out.shape == (t, k_out) and out.dtype == torch.bfloat16
    expected = fused_moe_loop(x, weights, topk_weights, topk_ids, moe.MoEActivation(), fp8_dtype)
    assert_rel(out, expected, BF16_OUT_TOL, f"fused_moe {fmt}/{act_quant}")


@pytest.mark.parametrize(
    "activation, act_quant, fp8_dtype, tol",
    [
        pytest.param(moe.MoEActivation(), "bf16", None, 1e-5, id="situ-A16W4"),
        pytest.param(moe.MoEActivation("situ", 4.0, None), "bf16", None, 1e-5, id="situ-lbNone-A16W4"),
        pytest.param(moe.MoEActivation("silu"), "bf16", None, 1e-5, id="silu-A16W4"),
        pytest.param(moe.MoEActivation(), "mxfp8", torch.float8_e4m3fnuz, 1e-4, id="situ-A8W4-fnuz"),
    ],
)
def test_fused_moe_fp32_activations(activation, act_quant, fp8_dtype, tol):
    weights = make_experts("mxfp4", 8, 128, 64, 128, seed=43)
    topk_weights, topk_ids = make_routing(7, 8, 2, seed=44)
    x = torch.randn(7, 128, generator=seeded(45)) * 2
    out = moe.fused_moe(
        x, weights, topk_weights, topk_ids, activation=activation, act_quant=act_quant, fp8_dtype=fp8_dtype
    )
    assert out.dtype == torch.float32
    assert_rel(out, fused_moe_loop(x, weights, topk_weights, topk_ids, activation, fp8_dtype), tol, "fused_moe fp32")


def test_fused_moe_empty_batch():
    weights = make_experts("mxfp4", 8, 64, 64, 64, seed=46)
    out = moe.fused_moe(torch.zeros(0, 64), weights, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 64)


def test_expert_weights_validation_and_properties():
    w = make_experts("mxfp4", 4, 64, 96, 32, seed=47)
    assert (w.num_experts, w.hidden, w.intermediate, w.out_features) == (4, 64, 96, 32)
    dense = make_experts("bf16", 4, 64, 96, 32, seed=47)
    assert (dense.num_experts, dense.hidden, dense.intermediate, dense.out_features) == (4, 64, 96, 32)
    with pytest.raises(ValueError, match="fmt"):
        moe.ExpertWeights("fp8", w.w13, w.w13_scale, w.w2, w.w2_scale)
    with pytest.raises(ValueError, match=r"w13_scale must have shape \[E, 2N, K/32\]"):
        moe.ExpertWeights("mxfp4", w.w13, w.w13_scale[:, :, :1], w.w2, w.w2_scale)
    with pytest.raises(ValueError, match=r"w2 must have shape \[E, Kout, N/2\]"):
        moe.ExpertWeights("mxfp4", w.w13, w.w13_scale, w.w2[:3], w.w2_scale)
    with pytest.raises(TypeError, match="w13 must have dtype torch.uint8"):
        moe.ExpertWeights("mxfp4", w.w13.float(), w.w13_scale, w.w2, w.w2_scale)
    with pytest.raises(TypeError, match="w2_scale must be a torch.Tensor"):
        moe.ExpertWeights("mxfp4", w.w13, w.w13_scale, w.w2, None)
    with pytest.raises(ValueError, match="take no scales"):
        moe.ExpertWeights("bf16", dense.w13, w.w13_scale, dense.w2, None)
    with pytest.raises(ValueError, match=r"w2 must have shape \[E, Kout, N\]"):
        moe.ExpertWeights("bf16", dense.w13, None, dense.w2[:, :, :32], None)


def test_fused_moe_boundary_errors():
    weights = make_experts("mxfp4", 8, 64, 64, 64, seed=48)
    tw, ids = make_routing(3, 8, 2, seed=49)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        moe.fused_moe(x[None], weights, tw, ids)
    with pytest.raises(ValueError, match=r"K = weights.hidden = 64"):
        moe.fused_moe(torch.randn(3, 32), weights, tw, ids)
    with pytest.raises(TypeError, match="x must have dtype"):
        moe.fused_moe(x.double(), weights, tw, ids)
    with pytest.raises(TypeError, match="topk_ids must have dtype torch.int32"):
        moe.fused_moe(x, weights, tw, ids.long())
    with pytest.raises(ValueError, match=r"topk_weights must have shape \[T, k\]"):
        moe.fused_moe(x, weights, tw[:, :1], ids)
    with pytest.raises(ValueError, match=r"topk_ids must have shape \[T, k\] with T = 3"):
        moe.fused_moe(x, weights, tw[:2], ids[:2])
    for bad in (-1, 8):
        bad_ids = ids.clone()
        bad_ids[1, 0] = bad
        with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, E=8\)"):
            moe.fused_moe(x, weights, tw, bad_ids)
    with pytest.raises(ValueError, match="act_quant"):
        moe.fused_moe(x, weights, tw, ids, act_quant="int4")
    with pytest.raises(ValueError, match="needs fp8_dtype"):
        moe.fused_moe(x, weights, tw, ids, act_quant="mxfp8")
    with pytest.raises(TypeError, match="fp8_dtype"):
        moe.fused_moe(x, weights, tw, ids, act_quant="mxfp8", fp8_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="activation must be a MoEActivation"):
        moe.fused_moe(x, weights, tw, ids, activation="situ")
    with pytest.raises(TypeError, match="weights must be an ExpertWeights"):
        moe.fused_moe(x, {"w13": weights.w13}, tw, ids)
    with pytest.raises(ValueError, match="unknown backend"):
        moe.fused_moe(x, weights, tw, ids, backend="cuda-magic")


def test_fused_moe_backend_that_cannot_run_the_call_says_why():
    weights = make_experts("mxfp4", 8, 64, 64, 64, seed=50)
    tw, ids = make_routing(3, 8, 2, seed=51)
    with pytest.raises(BackendError, match="flydsl") as info:
        moe.fused_moe(torch.randn(3, 64), weights, tw, ids, backend="flydsl")
    reason = str(info.value).split(": ", 1)[1]
    assert reason.strip(), f"BackendError without a reason: {info.value}"


def test_fused_moe_reference_token_chunks(monkeypatch):
    # a tiny chunk budget makes every expert run several token chunks (bounded memory path)
    monkeypatch.setattr(moe_reference, "_CHUNK_ELEMENTS", 3 * 128)  # 3 rows of [*, 2N = 128]
    weights = make_experts("mxfp4", 8, 64, 64, 64, seed=52)
    topk_weights, topk_ids = make_routing(33, 8, 4, seed=53)
    x = torch.randn(33, 64, generator=seeded(54))
    out = moe.fused_moe(x, weights, topk_weights, topk_ids)
    assert_rel(out, fused_moe_loop(x, weights, topk_weights, topk_ids, moe.MoEActivation()), 1e-5, "chunked fused_moe")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_reference_moe_ops_on_gpu_match_loop(mode):
    fmt, act_quant, fp8_dtype = mode
    logits = torch.randn(33, 16, generator=seeded(55)) * 2
    bias = torch.randn(16, generator=seeded(56)) * 0.3
    routed = moe.route(logits.cuda(), 4, correction_bias=bias.cuda(), backend="reference")
    weights_ref, ids_ref = route_py(logits, 4, bias)
    assert routed.ids.cpu().tolist() == ids_ref
    assert_rel(routed.weights, weights_ref, 1e-6, "route weights (gpu)")
    experts = make_experts(fmt, 16, 128, 96, 128, seed=57)
    gpu_experts = moe.ExpertWeights(
        experts.fmt,
        experts.w13.cuda(),
        None if experts.w13_scale is None else experts.w13_scale.cuda(),
        experts.w2.cuda(),
        None if experts.w2_scale is None else experts.w2_scale.cuda(),
    )
    x = torch.randn(33, 128, generator=seeded(58))
    out = moe.fused_moe(
        x.cuda(), gpu_experts, routed.weights, routed.ids, act_quant=act_quant, fp8_dtype=fp8_dtype, backend="reference"
    )
    expected = fused_moe_loop(x, experts, routed.weights.cpu(), routed.ids.cpu(), moe.MoEActivation(), fp8_dtype)
    assert_rel(out, expected, 1e-4 if act_quant == "mxfp8" else 1e-5, "fused_moe (gpu)")
