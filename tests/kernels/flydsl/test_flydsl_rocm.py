"""`rocm` tier: the FlyDSL kernels executed on an MI300X (gfx942) / MI355X (gfx950), parity with the references.

Skipped (with the reason, by conftest) unless torch sees a ROCm GPU. On such a machine run:

    pytest -m rocm tests/kernels/flydsl/test_flydsl_rocm.py

Every kernel is compared with the pure-PyTorch reference of its op on the same inputs (random, seeded);
outputs are poisoned before the kernel writes them where the op writes in place. Tolerances are relative
errors (``tests.helpers.rel_err``) per tensor: bf16 outputs 1e-2 (a bf16 ulp is 2^-8 relative), fp32 states
1e-5, MoE A16W4 2e-2 (the kernel feeds the intermediate h to the second GEMM in bf16, the reference in
fp32), A8W4 3e-2 (MXFP8 codes can differ by one step where fp32 summation order moves a value across a
rounding boundary).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_rel, seeded

pytestmark = pytest.mark.rocm

DEV = "cuda"  # ROCm torch exposes AMD GPUs as "cuda" devices


def _arch() -> str:
    from rocm_k3.ops.devices import device_info

    return device_info(torch.device(DEV)).arch


def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=seeded(seed)) * scale).to(dtype).to(DEV)


@pytest.fixture(scope="module", autouse=True)
def _flydsl_is_picked() -> None:
    from rocm_k3.ops import registry
    from rocm_k3.ops.devices import device_info

    ok, why = registry.backend_available("flydsl", device_info(torch.device(DEV)))
    assert ok, f"flydsl backend unavailable on this ROCm machine: {why}"


NORM_SHAPES = [(1, 7168), (37, 7168), (300, 1536), (5, 512)]


@pytest.mark.parametrize("rows,D", NORM_SHAPES, ids=[f"R{r}-D{d}" for r, d in NORM_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rms_norm_and_add_rms_norm(rows: int, D: int, dtype: torch.dtype) -> None:
    from rocm_k3 import ops

    x, res, w = rnd(rows, D, dtype=dtype, seed=1), rnd(rows, D, dtype=dtype, seed=2), rnd(D, dtype=dtype, seed=3)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert_rel(ops.rms_norm(x, w, backend="flydsl"), ops.rms_norm(x, w, backend="reference"), tol, "rms_norm")
    y, r = ops.add_rms_norm(x, res, w, backend="flydsl")
    y_ref, r_ref = ops.add_rms_norm(x, res, w, backend="reference")
    assert_rel(r, r_ref, tol if dtype == torch.float32 else 4e-3, "new residual")
    assert_rel(y, y_ref, tol, "add_rms_norm")


@pytest.mark.parametrize("T,H", [(1, 96), (64, 12), (130, 4)], ids=["T1-H96", "T64-H12", "T130-H4"])
def test_gated_rms_norm(T: int, H: int) -> None:
    from rocm_k3.ops.kda import gated_rms_norm

    x, gate, w = rnd(T, H, 128, seed=4), rnd(T, H, 128, seed=5), rnd(128, seed=6)
    assert_rel(gated_rms_norm(x, gate, w, backend="flydsl"), gated_rms_norm(x, gate, w, backend="reference"),
               1e-2, "gated_rms_norm")


ATTN_RES = [(3, 8, False, True, True), (17, 3, True, True, True), (4, 0, False, False, True), (9, 5, True, True, False)]


@pytest.mark.parametrize("T,nb,write,has_p,has_d", ATTN_RES,
                         ids=[f"T{t}-B{b}-{'w' if w else 'nw'}-{'p' if p else ''}{'d' if d else ''}"
                              for t, b, w, p, d in ATTN_RES])
def test_attn_res_step(T: int, nb: int, write: bool, has_p: bool, has_d: bool) -> None:
    from rocm_k3.ops.attn_res import attn_res_step

    Hd = 7168
    partial = rnd(T, Hd, seed=7) if has_p else None
    delta = rnd(T, Hd, seed=8) if has_d else None
    blocks = rnd(9, T, Hd, seed=9)
    kw = {"write_block": write, "proj_weight": rnd(Hd, seed=10, scale=0.05), "norm_weight": rnd(Hd, seed=11),
          "rms_weight": rnd(Hd, seed=12)}
    bank_ref, bank = blocks.clone(), blocks.clone()
    if write:
        bank[nb] = float("nan")  # poisoned: the kernel must write the snapshot
    out = attn_res_step(partial, delta, bank, nb, backend="flydsl", **kw)
    ref = attn_res_step(partial, delta, bank_ref, nb, backend="reference", **kw)
    assert_rel(out.partial, ref.partial, 4e-3, "p")
    assert_rel(out.normed, ref.normed, 1e-2, "normed")
    assert_rel(bank, bank_ref, 4e-3, "block bank")


@pytest.mark.parametrize("N,H,K,lower", [(1, 96, 128, -5.0), (5, 12, 128, -5.0), (3, 4, 128, None), (6, 2, 32, -5.0)],
                         ids=["N1-H96-safe", "N5-H12-safe", "N3-H4-softplus", "N6-H2-D32-safe"])
def test_kda_decode(N: int, H: int, K: int, lower: float | None) -> None:
    from rocm_k3.ops.kda import kda_decode

    W, S = 4, N + 3
    C = 3 * H * K
    args = {
        "qkv": rnd(N, C, seed=13), "f": rnd(N, H * K, seed=14), "beta": rnd(N, H, seed=15),
        "out_gate": rnd(N, H * K, seed=16), "conv_weight": rnd(C, W, seed=17, scale=0.5),
        "A_log": rnd(H, dtype=torch.float32, seed=18, scale=0.5), "dt_bias": rnd(H * K, dtype=torch.float32, seed=19),
        "o_norm_weight": rnd(K, seed=20),
    }
    conv_state = rnd(S, C, W - 1, seed=21)
    state = rnd(S, H, K, K, dtype=torch.float32, seed=22, scale=0.1)
    slots = torch.randperm(S, generator=seeded(23))[:N].to(torch.int32).to(DEV)
    cs_ref, st_ref = conv_state.clone(), state.clone()
    y = kda_decode(**args, conv_state=conv_state, state=state, state_indices=slots, num_heads=H, lower_bound=lower,
                   backend="flydsl")
    y_ref = kda_decode(**args, conv_state=cs_ref, state=st_ref, state_indices=slots, num_heads=H, lower_bound=lower,
                       backend="reference")
    assert_rel(y, y_ref, 1e-2, "y")
    assert_rel(state, st_ref, 1e-5, "state")
    assert torch.equal(conv_state, cs_ref), "conv_state"


@pytest.mark.parametrize("shape", [(3, 2 * 6144), (17, 2 * 768), (1, 7, 2 * 4224)], ids=["T3-N6144", "T17-N768", "B1x7-N4224"])
def test_situ_and_silu_and_mul(shape: tuple[int, ...]) -> None:
    from rocm_k3.ops.moe import silu_and_mul, situ_and_mul

    x = rnd(*shape, seed=40, scale=4.0)
    assert_rel(situ_and_mul(x, backend="flydsl"), situ_and_mul(x, backend="reference"), 1e-2, "situ_and_mul")
    assert_rel(situ_and_mul(x, 4.0, None, backend="flydsl"), situ_and_mul(x, 4.0, None, backend="reference"), 1e-2,
               "situ_and_mul (no linear beta)")
    assert_rel(silu_and_mul(x, backend="flydsl"), silu_and_mul(x, backend="reference"), 1e-2, "silu_and_mul")


@pytest.mark.parametrize("T,E,k,bias,renorm,scale", [(1, 896, 16, True, True, 1.0), (33, 256, 8, False, True, 2.446),
                                                    (5, 64, 6, True, False, 1.0)],
                         ids=["T1-E896-k16", "T33-E256-k8-nobias", "T5-E64-k6-norenorm"])
def test_route(T: int, E: int, k: int, bias: bool, renorm: bool, scale: float) -> None:
    from rocm_k3.ops.moe import route

    logits = rnd(T, E, dtype=torch.float32, seed=44)
    logits[:, : E // 4] = 0.5  # ties: equal scores must go to the lower expert index
    kw = {"correction_bias": rnd(E, dtype=torch.float32, seed=45, scale=0.01) if bias else None,
          "renormalize": renorm, "scaling_factor": scale}
    out, ref = route(logits, k, backend="flydsl", **kw), route(logits, k, backend="reference", **kw)
    assert torch.equal(out.ids, ref.ids), "ids"
    assert_rel(out.weights, ref.weights, 1e-6, "weights")


CONV = [([1, 2, 70], True), ([5, 0, 3], True), ([40], False)]


@pytest.mark.parametrize("lens,with_state", CONV, ids=["3seq-state", "short+empty-state", "1seq-nostate"])
def test_short_conv(lens: list[int], with_state: bool) -> None:
    from rocm_k3.ops.kda import short_conv

    C, W = 3 * 4 * 128, 4
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32).to(DEV)
    x, w = rnd(T, C, seed=41), rnd(C, W, seed=42, scale=0.5)
    kw = {}
    if with_state:
        kw = {"state_indices": torch.arange(N, dtype=torch.int32, device=DEV) + 1,
              "has_initial_state": torch.tensor([i % 2 == 1 for i in range(N)], device=DEV)}
    state = rnd(N + 2, C, W - 1, seed=43)
    st_ref = state.clone()
    y = short_conv(x, w, cu, conv_state=state if with_state else None, backend="flydsl", **kw)
    y_ref = short_conv(x, w, cu, conv_state=st_ref if with_state else None, backend="reference", **kw)
    assert_rel(y, y_ref, 1e-2, "y")
    assert torch.equal(state, st_ref), "conv_state"


# (lens, gate, intermediate positions, K, activation dtype): positions on the 64-token grid (or at a sequence's
# end) run the chunked kernels, any other position the recurrent kernel (ops_impl.kda_prefill_supports says which)
BF16, F16 = torch.bfloat16, torch.float16
PREFILL = [([5, 64, 130], "safe", [(1, 64), (2, 128), (2, 130), (1, 64)], 128, BF16), ([1, 33], None, [], 128, BF16),
           ([70], "softplus", [(0, 70)], 128, BF16), ([9, 200], "safe", [(1, 64), (1, 192)], 32, BF16),
           ([5, 64, 130], "safe", [(1, 64), (2, 7)], 128, BF16), ([9, 20], "safe", [(1, 5)], 32, BF16),
           ([5, 64, 130], "safe", [(1, 64), (2, 128)], 128, F16)]


def _state_tol(reason: str) -> float:
    """States' bound for the path ``kda_prefill_supports`` names: the chunked walk on bf16 MFMA (bf16 activations)
    rounds its operands to bf16 as the Triton twin's bf16 dots do and meets that twin's bound (1e-2, its cuda tier);
    the fp32 walk and the recurrent kernel are exact fp32 up to summation order (1e-4)."""
    return 1e-2 if "bf16 MFMA" in reason else 1e-4


@pytest.mark.parametrize("lens,gate,save,K,dtype", PREFILL,
                         ids=["3seq-safe-grid-save", "2seq-logdecay", "1seq-softplus-save-end", "2seq-D32-grid-save",
                              "3seq-safe-offgrid-recurrent", "2seq-D32-offgrid-recurrent", "3seq-safe-fp16-fp32-walk"])
def test_kda_prefill(lens: list[int], gate: str | None, save: list[tuple[int, int]], K: int,
                     dtype: torch.dtype) -> None:
    from rocm_k3.flydsl_kernels.ops_impl import kda_prefill_supports
    from rocm_k3.ops.kda import KDAGateParams, kda_prefill

    H = 4
    T, N, S = sum(lens), len(lens), len(lens) + 2
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32).to(DEV)
    q, k, v = rnd(T, H, K, dtype=dtype, seed=30), rnd(T, H, K, dtype=dtype, seed=31), rnd(T, H, K, dtype=dtype, seed=32)
    params = None
    if gate is None:
        g = -torch.rand(T, H, K, generator=seeded(33)).to(DEV) * 0.5  # fp32 log-decay
    else:
        g = rnd(T, H, K, dtype=dtype, seed=33)
        params = KDAGateParams(rnd(H, dtype=torch.float32, seed=34, scale=0.3), rnd(H * K, dtype=torch.float32, seed=35),
                               -5.0 if gate == "safe" else None)
    beta = rnd(T, H, dtype=dtype, seed=36)
    state = rnd(S, H, K, K, dtype=torch.float32, seed=37, scale=0.1)
    slots = torch.arange(N, dtype=torch.int32, device=DEV) + 1
    has_init = torch.tensor([i % 2 == 0 for i in range(N)], device=DEV)
    pos = torch.tensor(save, dtype=torch.int32, device=DEV) if save else None
    st_ref = state.clone()
    _, reason = kda_prefill_supports(q, k, v, g, beta, cu, state, slots, has_init, gate_params=params,
                                     intermediate_positions=pos)
    out = kda_prefill(q, k, v, g, beta, cu, state, slots, has_init, gate_params=params, intermediate_positions=pos,
                      backend="flydsl")
    ref = kda_prefill(q, k, v, g, beta, cu, st_ref, slots, has_init, gate_params=params, intermediate_positions=pos,
                      backend="reference")
    assert_rel(out.o, ref.o, 1e-2, "o")
    assert_rel(state, st_ref, _state_tol(reason), "final states")
    if save:
        assert_rel(out.intermediate_states, ref.intermediate_states, _state_tol(reason), "intermediate states")


@pytest.mark.parametrize("lens,save,path", [([9, 70], [(1, 64)], "chunked"), ([9, 70], [(1, 5)], "recurrent")],
                         ids=["chunked", "recurrent"])
def test_kda_prefill_without_norms_or_beta_logits(lens: list[int], save: list[tuple[int, int]], path: str) -> None:
    """qk_l2norm and beta_logits off (the intra kernel's row factors are then 1 and the scale; b is read as is):
    small q, k keep the unnormalised delta rule stable."""
    from rocm_k3.ops.kda import kda_prefill

    H, K = 4, 128
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32).to(DEV)
    q, k, v = rnd(T, H, K, seed=40, scale=0.05), rnd(T, H, K, seed=41, scale=0.05), rnd(T, H, K, seed=42)
    g = -torch.rand(T, H, K, generator=seeded(43)).to(DEV) * 0.5
    beta = torch.rand(T, H, generator=seeded(44)).to(DEV, torch.bfloat16)
    state = rnd(N + 1, H, K, K, dtype=torch.float32, seed=45, scale=0.1)
    slots = torch.arange(N, dtype=torch.int32, device=DEV) + 1
    has_init = torch.tensor([True, False], device=DEV)
    pos = torch.tensor(save, dtype=torch.int32, device=DEV)
    st_ref = state.clone()
    kw = dict(qk_l2norm=False, beta_logits=False, intermediate_positions=pos)
    from rocm_k3.flydsl_kernels.ops_impl import kda_prefill_supports

    ok, reason = kda_prefill_supports(q, k, v, g, beta, cu, state, slots, has_init, **kw)
    assert ok and f"{path}" in reason, reason  # the intended kernels run (ops_impl names them)
    out = kda_prefill(q, k, v, g, beta, cu, state, slots, has_init, backend="flydsl", **kw)
    ref = kda_prefill(q, k, v, g, beta, cu, st_ref, slots, has_init, backend="reference", **kw)
    assert_rel(out.o, ref.o, 1e-2, "o")
    assert_rel(state, st_ref, _state_tol(reason), "final states")
    assert_rel(out.intermediate_states, ref.intermediate_states, _state_tol(reason), "intermediate states")


MOE = [(1, 4, 8), (37, 4, 8), (129, 8, 16)]


@pytest.mark.parametrize("act_quant", ["bf16", "mxfp8"], ids=["A16W4", "A8W4"])
@pytest.mark.parametrize("T,top_k,E", MOE, ids=[f"T{t}-k{k}-E{e}" for t, k, e in MOE])
def test_fused_moe(T: int, top_k: int, E: int, act_quant: str) -> None:
    from rocm_k3.flydsl_kernels.backend import prepare_weights
    from rocm_k3.ops.moe import ExpertWeights, fused_moe
    from rocm_k3.ops.quant import fp8_dtype_for_arch, quantize_mxfp4

    K, N, Kout = 512, 256, 384
    w13, s13 = quantize_mxfp4(rnd(E, 2 * N, K, dtype=torch.float32, seed=24, scale=0.05))
    w2, s2 = quantize_mxfp4(rnd(E, Kout, N, dtype=torch.float32, seed=25, scale=0.05))
    weights = ExpertWeights(fmt="mxfp4", w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    x = rnd(T, K, seed=26)
    logits = torch.randn(T, E, generator=seeded(27)).to(DEV)
    topk_weights, topk_ids = torch.topk(torch.sigmoid(logits), top_k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    fp8 = fp8_dtype_for_arch(_arch()) if act_quant == "mxfp8" else None
    kw = {"act_quant": act_quant, "fp8_dtype": fp8}
    out = fused_moe(x, prepare_weights(weights), topk_weights, topk_ids.to(torch.int32), backend="flydsl", **kw)
    ref = fused_moe(x, weights, topk_weights, topk_ids.to(torch.int32), backend="reference", **kw)
    assert_rel(out, ref, 2e-2 if act_quant == "bf16" else 3e-2, f"fused_moe {act_quant}")


@pytest.mark.parametrize("act_quant", ["bf16", "mxfp8"], ids=["A16W4", "A8W4"])
@pytest.mark.parametrize("T", [1, 64], ids=["T1", "T64"])
def test_fused_moe_k3_expert_shapes(T: int, act_quant: str) -> None:
    """K3 expert shapes (K 3584 -> 2 x 3072 -> 3584), 32 experts, top-16: the 2-deep prefetch ring over 28 / 24
    K groups, the per-block accumulator scaling of gfx942 and, at T = 1, the w2 split in K (``w2_split_k``);
    E8M0 bytes 0 and 1 on some blocks (2^-127, 2^-126). Tolerances as in ``test_fused_moe``."""
    from rocm_k3.flydsl_kernels.backend import prepare_weights
    from rocm_k3.flydsl_kernels.moe import w2_split_k
    from rocm_k3.ops.moe import ExpertWeights, fused_moe
    from rocm_k3.ops.quant import fp8_dtype_for_arch

    E, K, N = 32, 3584, 3072
    g = torch.Generator(device=DEV).manual_seed(28)
    w13 = torch.randint(0, 256, (E, 2 * N, K // 2), dtype=torch.uint8, device=DEV, generator=g)
    w2 = torch.randint(0, 256, (E, K, N // 2), dtype=torch.uint8, device=DEV, generator=g)
    s13 = torch.randint(118, 123, (E, 2 * N, K // 32), dtype=torch.uint8, device=DEV, generator=g)
    s2 = torch.randint(118, 123, (E, K, N // 32), dtype=torch.uint8, device=DEV, generator=g)
    s13[0, :8, :4] = 0
    s2[1, :8, :4] = 1
    weights = ExpertWeights(fmt="mxfp4", w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    x = rnd(T, K, seed=29)
    topk_weights, topk_ids = torch.topk(torch.sigmoid(torch.randn(T, E, generator=seeded(30)).to(DEV)), 16, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    if T == 1:
        assert w2_split_k(16, K, N, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    fp8 = fp8_dtype_for_arch(_arch()) if act_quant == "mxfp8" else None
    kw = {"act_quant": act_quant, "fp8_dtype": fp8}
    out = fused_moe(x, prepare_weights(weights), topk_weights, topk_ids.to(torch.int32), backend="flydsl", **kw)
    ref = fused_moe(x, weights, topk_weights, topk_ids.to(torch.int32), backend="reference", **kw)
    assert_rel(out, ref, 2e-2 if act_quant == "bf16" else 3e-2, f"fused_moe K3 {act_quant}")


MLA_PREFILL = [([300, 700], [300, 150], None), ([1000], [200], "bf16"), ([130, 4000], [130, 512], "f32")]


@pytest.mark.parametrize("segment", [32768, 256], ids=["one_segment", "segments"])
@pytest.mark.parametrize("lens,news,gate", MLA_PREFILL, ids=["prefill+chunk", "chunk-gate-bf16", "long-gate-f32"])
def test_mla_prefill_expanded(lens: list[int], news: list[int], gate: str | None, segment: int,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The expanded-heads MLA prefill (TP-8 heads, the released 512 + 64 latent, Dn = Dv = 128, bf16) against the
    reference, causal, chunked prefill (queries = the last ``news[i]`` of ``lens[i]`` context tokens, shuffled
    64-token pages), with and without the output gate, the context in one segment or in 256-key segments (the
    state carried between launches, a segment boundary inside the diagonal). Tolerance 1e-2 per sequence, as the
    Triton twin's bf16 tier: the expanded K/V are rounded to bf16 once, the probabilities once more for the PV
    MFMA."""
    from rocm_k3.flydsl_kernels import mla_ops
    from rocm_k3.ops.mla import mla_prefill

    monkeypatch.setattr(mla_ops, "SEGMENT_KEYS", segment)
    H, R, P, Dn, Dv, bs = 12, 512, 64, 128, 128, 64
    gen = seeded(31)
    per = max(-(-n // bs) for n in lens)
    pages = per * len(lens) + 2
    cache = (torch.randn(pages, bs, R + P, generator=gen)).to(torch.bfloat16).to(DEV)
    table = torch.randperm(pages, generator=gen)[: per * len(lens)].view(len(lens), per).to(torch.int32).to(DEV)
    cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    T = int(cu[-1])
    q = rnd(T, H, Dn + P, seed=32)
    w = rnd(H * (Dn + Dv), R, seed=33, scale=R ** -0.5)
    g = None if gate is None else rnd(T, H, Dv, seed=34, scale=2.0, dtype={"bf16": torch.bfloat16,
                                                                             "f32": torch.float32}[gate])
    out = mla_prefill(q, cache, table, cu, seq_lens, w, gate=g, backend="flydsl")
    ref = mla_prefill(q, cache, table, cu, seq_lens, w, gate=g, backend="reference")
    assert out.dtype == torch.bfloat16 and out.shape == (T, H, Dv)
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        assert_rel(out[rows], ref[rows], 1e-2, f"mla_prefill seq {i}")


def test_tiny_model_generates_like_reference() -> None:
    """The embedded tiny K3 with automatic dispatch (flydsl first on ROCm, other backends for ops it lacks)
    against the reference backend: greedy continuations agree and per-token logprobs are close."""
    import rocm_k3

    params = rocm_k3.SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    prompts = ["Hello", "The quick brown fox"]
    fly = rocm_k3.LLM(None, dtype="bfloat16", backend=None, device=DEV).generate(prompts, params)
    ref = rocm_k3.LLM(None, dtype="bfloat16", backend="reference", device=DEV).generate(prompts, params)
    for a, b in zip(fly, ref):
        assert a.token_ids[:4] == b.token_ids[:4], (a.token_ids, b.token_ids)
        lp_a = torch.tensor([next(iter(d.values())) for d in a.logprobs[:4]])
        lp_b = torch.tensor([next(iter(d.values())) for d in b.logprobs[:4]])
        assert torch.allclose(lp_a, lp_b, atol=5e-2), (lp_a, lp_b)
