"""Triton kernels vs the reference ops, in three tiers.

- ``interpret``: small fp32 shapes under ``TRITON_INTERPRET=1`` on the CPU. Triton reads that variable when
  ``triton`` is first imported (every ``@triton.jit``, its standard library included, is decorated then), so this
  module sets it before importing triton. If triton was already imported in this process without it, the tier
  re-runs this module in a subprocess (``test_interpret_tier_in_subprocess``).
- ``compile``: every kernel cross-compiled for sm_90, gfx942, gfx950 (tests/triton_compile_driver.py runs in a
  fresh interpreter), asserting the matrix instructions (wgmma/mma, v_mfma) and no scratch spills on AMD.
- ``cuda``: K3 shapes in bf16 on an NVIDIA GPU against the reference backend.

Tolerances (relative L2 error, tests/helpers.rel_err): fp32 kernels 1e-5, the fp32-activation MoE included (fp32
operands, IEEE dots: only summation order and tanh/sigmoid rounding differ; measured <= 3e-7); MoE with bf16
activations 1.5e-2 (bf16 MMA operands: the intermediate activation is rounded to bf16 once more than in the
reference); bf16 outputs on the GPU 1e-2 (a few bf16 ulps, 2^-8 each).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import: see the module docstring

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from rocm_k3.ops import attn_res as ref_attn_res  # noqa: E402
from rocm_k3.ops import mla as ref_mla  # noqa: E402
from rocm_k3.ops import norm as ref_norm  # noqa: E402
from rocm_k3.ops.kda import gated_rms_norm as ref_gated_rms_norm  # noqa: E402
from rocm_k3.ops.moe import ExpertWeights, MoEActivation  # noqa: E402
from rocm_k3.ops.moe_reference import (  # noqa: E402
    fused_moe_reference,
    route_reference,
    silu_and_mul_reference,
    situ_and_mul_reference,
)
from rocm_k3.triton_kernels import attn_res as tri_attn_res  # noqa: E402
from rocm_k3.triton_kernels import norm as tri_norm  # noqa: E402
from rocm_k3.triton_kernels import mla_prefill as tri_mla_prefill  # noqa: E402
from rocm_k3.triton_kernels.mla_decode import mla_decode_with  # noqa: E402
from rocm_k3.triton_kernels.moe.align import align_path, align_routing  # noqa: E402
from rocm_k3.triton_kernels.moe import pointwise as tri_pointwise  # noqa: E402
from rocm_k3.triton_kernels.moe.fused import (  # noqa: E402
    MoEConfig,
    fused_moe_supports,
    fused_moe_with,
    pick_config,
    prepare_weights,
)
from rocm_k3.triton_kernels.runtime import interpreted  # noqa: E402
from tests.helpers import moe_routing as _routing  # noqa: E402
from tests.helpers import mxfp4_experts as _mxfp4_experts  # noqa: E402
from tests.helpers import (  # noqa: E402
    assert_rel,
    poisoned_like,
    run_compile_driver,
    run_interpret_tier,
    seeded,
)

# both ours and Triton's own standard library must be interpreted (see the module docstring)
_INTERPRETED = interpreted(tri_norm._rms_norm_kernel) and interpreted(triton.language.sigmoid)
needs_interp = pytest.mark.skipif(
    not _INTERPRETED, reason="kernels are compiled in this process (GPU host, or triton imported before "
                             "TRITON_INTERPRET=1); the interpreter tier runs in test_interpret_tier_in_subprocess")
FP8 = {"ocp": torch.float8_e4m3fn, "fnuz": torch.float8_e4m3fnuz}


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0, device: str = "cpu",
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------------- interpret tier
@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("rows,d", [(7, 96), (3, 200)], ids=["R7-D96", "R3-D200"])
def test_norms_interpret(rows: int, d: int) -> None:
    g = seeded(1)
    x, r, gate, w = (_randn(rows, 2, d, gen=g) for _ in range(4))
    assert_rel(tri_norm.rms_norm(x, w[0, 0]), ref_norm.rms_norm_reference(x, w[0, 0]), 1e-5, "rms_norm")
    normed, res = tri_norm.add_rms_norm(x, r, w[0, 0])
    ref_normed, ref_res = ref_norm.add_rms_norm_reference(x, r, w[0, 0])
    assert_rel(res, ref_res, 1e-6, "new_residual")
    assert_rel(normed, ref_normed, 1e-5, "normed")
    out = tri_norm.gated_rms_norm(x, gate, w[0, 0])
    assert_rel(out, ref_gated_rms_norm(x, gate, w[0, 0], backend="reference"), 1e-5, "gated_rms_norm")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("layout", ["head-stride-2D", "broadcast-tokens", "broadcast-heads", "heads-major",
                                    "strided-last-dim"])
def test_gated_rms_norm_gate_layouts_interpret(layout: str) -> None:
    """Gates the in-place read must address right (head stride != D, zero strides of an expand, heads outermost)
    and one it must not read in place (last dim strided: copied), against the reference."""
    g = seeded(6)
    t, h, d = 5, 3, 64
    x, w = _randn(t, h, d, gen=g), _randn(d, gen=g)
    gate = {"head-stride-2D": lambda: _randn(t, h, 2 * d, gen=g)[:, :, d:],
            "broadcast-tokens": lambda: _randn(1, h, d, gen=g).expand(t, h, d),
            "broadcast-heads": lambda: _randn(t, 1, d, gen=g).expand(t, h, d),
            "heads-major": lambda: _randn(h, t, d, gen=g).transpose(0, 1),
            "strided-last-dim": lambda: _randn(t, h, 2 * d, gen=g)[:, :, ::2]}[layout]()
    out = tri_norm.gated_rms_norm(x, gate, w)
    assert not out.isnan().any()
    assert_rel(out, ref_gated_rms_norm(x, gate, w, backend="reference"), 1e-5, f"gated_rms_norm {layout} gate")


@pytest.mark.interpret
@needs_interp
def test_gated_rms_norm_strided_gate_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """KDA's output gate as the model passes it: a column slice [T, H D] of a wider projection, viewed [T, H, D]
    (token stride 4 H D + 40, head stride D): read in place (it never reaches the reshaping _rows), the
    columns around it NaN, equal to the contiguous gate's result and to the reference."""
    g = seeded(4)
    t, h, d = 5, 3, 96
    x, w = _randn(t, h, d, gen=g), _randn(d, gen=g)
    wide = torch.full((t, 4 * h * d + 40), float("nan"))
    wide[:, h * d : 2 * h * d] = _randn(t, h * d, gen=g)
    gate = wide[:, h * d : 2 * h * d].reshape(t, h, d)  # strides (4 H D + 40, D, 1)
    want = tri_norm.gated_rms_norm(x, gate.contiguous(), w)
    rows = tri_norm._rows

    def rows_not_of_gate(t: torch.Tensor) -> torch.Tensor:  # _rows is what reshapes (and copies) [T, H, D] inputs
        assert t.data_ptr() != gate.data_ptr(), "the gate went through _rows (a [T H, D] copy)"
        return rows(t)

    monkeypatch.setattr(tri_norm, "_rows", rows_not_of_gate)
    out = tri_norm.gated_rms_norm(x, gate, w)
    assert not out.isnan().any()
    assert torch.equal(out, want), "the strided gate changed the result"
    assert_rel(out, ref_gated_rms_norm(x, gate, w, backend="reference"), 1e-5, "gated_rms_norm strided gate")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("has_partial,has_delta,num_blocks,write", [(True, True, 3, True), (False, True, 0, False),
                                                                   (True, False, 2, False)],
                         ids=["p+d-nb3-write", "d-nb0", "p-nb2"])
def test_attn_res_interpret(has_partial: bool, has_delta: bool, num_blocks: int, write: bool) -> None:
    g = seeded(2)
    t, hd, b_max = 5, 160, 4
    partial = _randn(t, hd, gen=g) if has_partial else None
    delta = _randn(t, hd, gen=g) if has_delta else None
    blocks = _randn(b_max, t, hd, gen=g)
    pw, nw, rw = (_randn(hd, gen=g) for _ in range(3))
    kw = dict(write_block=write, proj_weight=pw, norm_weight=nw, rms_weight=rw)
    blocks_k, blocks_r = blocks.clone(), blocks.clone()
    ref = ref_attn_res._attn_res_step_reference(partial, delta, blocks_r, num_blocks, **kw)
    for cfg in (None, tri_attn_res.AttnResConfig(2, 4, prefetch=False)):  # default (prefetching) and plain loop
        blocks_k = blocks.clone()
        out = tri_attn_res.attn_res_step_with(partial, delta, blocks_k, num_blocks, config=cfg, **kw)
        assert_rel(out.partial, ref.partial, 1e-6, "partial")
        assert_rel(out.normed, ref.normed, 1e-5, f"normed ({cfg})")
        assert_rel(blocks_k, blocks_r, 0.0, "blocks (in-place write)")
    if has_partial:
        mix = tri_attn_res.attn_res_mix(partial, blocks, num_blocks, pw, nw)
        assert_rel(mix, ref_attn_res._attn_res_mix_reference(partial, blocks, num_blocks, pw, nw), 1e-5, "mix")


# (kv_lora_rank, rope, nope, v): the released latent and two no release uses (one needs padded, masked tiles)
MLA_GEOMETRIES = {"released": (512, 64, 128, 128), "R32-P16": (32, 16, 32, 32), "R48-P24-N40-V24": (48, 24, 40, 24)}


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("geo", list(MLA_GEOMETRIES), ids=str)
@pytest.mark.parametrize("splits", [1, 4], ids=["splits1", "splits4"])
def test_mla_decode_interpret(splits: int, geo: str) -> None:
    lora, rope, _, _ = MLA_GEOMETRIES[geo]
    g = seeded(3)
    n, h, bs, pages = 3, 5, 16, 12
    cache = _randn(pages, bs, lora + rope, gen=g)
    table = torch.stack([torch.randperm(pages, generator=g)[:5] for _ in range(n)]).to(torch.int32)
    lens = torch.tensor([1, 37, 70], dtype=torch.int32)
    q, qpe = _randn(n, h, lora, gen=g), _randn(n, h, rope, gen=g)
    out = mla_decode_with(q, qpe, cache, table, lens, scale=0.07, splits=splits)
    assert_rel(out, ref_mla._mla_decode_reference(q, qpe, cache, table, lens, scale=0.07), 1e-5, "out_latent")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("geo", list(MLA_GEOMETRIES), ids=str)
def test_mla_prefill_and_cache_write_interpret(geo: str) -> None:
    lora, rope, nope, vd = MLA_GEOMETRIES[geo]
    g = seeded(8)
    h, bs, pages = 3, 16, 12
    cache = _randn(pages, bs, lora + rope, gen=g)
    table = torch.stack([torch.randperm(pages, generator=g)[:5] for _ in range(3)]).to(torch.int32)
    lens = torch.tensor([20, 5, 40], dtype=torch.int32)  # context after the step; new tokens 3, 5 (all), 18
    cu = torch.tensor([0, 3, 8, 26], dtype=torch.int32)
    q = _randn(26, h, nope + rope, gen=g)
    w = _randn(h * (nope + vd), lora, gen=g, scale=lora ** -0.5)
    out = tri_mla_prefill.mla_prefill(q, cache, table, cu, lens, w)
    assert out.shape == (26, h, vd)
    assert_rel(out, ref_mla._mla_prefill_reference(q, cache, table, cu, lens, w), 1e-5, "mla_prefill")
    latent = _randn(4, lora + rope, gen=g)
    slots = torch.tensor([3, -1, 17, 100], dtype=torch.int64)
    got, want = cache.clone(), cache.clone()
    tri_mla_prefill.mla_write_cache(latent, got, slots)
    ref_mla._mla_write_cache_reference(latent, want, slots)
    assert torch.equal(got, want)


def test_mla_kernels_decline_latents_they_were_not_sized_for(caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_lora_rank 1024 (tile 1024 > 512) or rope 96 (tile 128 > 64): supports() says why, and automatic
    dispatch falls back to the reference, logging the reason."""
    from rocm_k3.ops import registry
    from rocm_k3.triton_kernels import backend as triton_backend
    from rocm_k3.triton_kernels.mla_decode import mla_decode_supports
    from rocm_k3.triton_kernels.mla_prefill import mla_prefill_supports

    g = seeded(4)
    for lora, rope in ((1024, 64), (512, 96)):
        cache = _randn(2, 16, lora + rope, gen=g)
        args = (_randn(1, 2, lora, gen=g), _randn(1, 2, rope, gen=g), cache, torch.zeros(1, 1, dtype=torch.int32),
                torch.ones(1, dtype=torch.int32))
        ok, why = mla_decode_supports(*args, scale=0.1)
        assert not ok and f"kv_lora_rank {lora} / rope {rope}" in why and "at most 512 / 64" in why
        q, w = _randn(1, 2, 128 + rope, gen=g), _randn(2 * 256, lora, gen=g)
        pargs = (q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                 torch.ones(1, dtype=torch.int32), w)
        ok, why = mla_prefill_supports(*pargs)
        assert not ok and "Triton MLA kernels take at most" in why
    small = (_randn(1, 2, 48, gen=g), _randn(1, 2, 24, gen=g), _randn(2, 16, 72, gen=g),
             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    assert mla_decode_supports(*small, scale=0.1) == (True, "supported")  # padded to 64 / 32 tiles
    monkeypatch.setitem(registry.PRIORITY, "cpu", ("triton", "reference"))
    monkeypatch.setattr(triton_backend, "available", lambda dev: (True, "interpreter test"))
    with caplog.at_level("INFO", logger="rocm_k3.ops"):
        out = ref_mla.mla_decode(*args, scale=0.1, backend="auto")
    assert_rel(out, ref_mla._mla_decode_reference(*args, scale=0.1), 0.0, "fallback output")
    assert any("mla_decode: using reference backend" in r.getMessage() and "kv_lora_rank 512 / rope 96" in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.interpret
@needs_interp
def test_route_and_activations_interpret() -> None:
    g = seeded(9)
    x = _randn(3, 5, 80, gen=g, scale=3.0)
    assert_rel(tri_pointwise.situ_and_mul(x), situ_and_mul_reference(x), 1e-5, "situ_and_mul")
    assert_rel(tri_pointwise.situ_and_mul(x, 2.0, None), situ_and_mul_reference(x, 2.0, None), 1e-5, "situ lb=None")
    assert_rel(tri_pointwise.silu_and_mul(x), silu_and_mul_reference(x), 1e-6, "silu_and_mul")
    logits = _randn(7, 20, gen=g)
    logits[0, 5] = logits[0, 3]  # a tie: the lower expert index wins
    bias = _randn(20, gen=g, scale=0.1)
    for kw in (dict(), dict(correction_bias=bias, renormalize=False, scaling_factor=2.5)):
        got, want = tri_pointwise.route(logits, 4, **kw), route_reference(logits, 4, **kw)
        assert torch.equal(got.ids, want.ids), kw
        assert_rel(got.weights, want.weights, 1e-6, "route weights")
    # K3's shape with many exact ties (scores from three values, a two-valued bias) and a negative total score
    logits = torch.randint(-1, 2, (3, 896), generator=g).float()
    bias = torch.randint(0, 2, (896,), generator=g).float() * 0.25 - 0.9
    for kw in (dict(), dict(correction_bias=bias)):
        got, want = tri_pointwise.route(logits, 16, **kw), route_reference(logits, 16, **kw)
        assert torch.equal(got.ids, want.ids), kw
        assert_rel(got.weights, want.weights, 1e-6, "route weights, ties")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("t,k,e,bm", [(1, 4, 16, 16), (9, 3, 8, 4), (33, 4, 20, 16), (40, 3, 4, 16),
                                     (64, 16, 896, 16)],
                         ids=["T1-k4-E16", "T9-k3-E8", "T33-k4-E20", "T40-k3-E4-multiblock", "T64-k16-E896"])
def test_moe_align_kernel_matches_sort(t: int, k: int, e: int, bm: int) -> None:
    _check_align_kernel(_routing(t, e, k, seeded(4))[1], e, bm)


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("t,k,e,bm,chunk", [(40, 3, 4, 16, 16), (33, 4, 20, 4, 32), (40, 16, 896, 16, 256)],
                         ids=["T40-k3-E4-8chunks", "T33-k4-E20-bm4-5chunks", "T40-k16-E896-3chunks"])
def test_moe_align_chunked_kernels_match_sort(t: int, k: int, e: int, bm: int, chunk: int) -> None:
    """The three-launch align of large routings (chunks of ``chunk`` pairs; K3 prefill uses 1024) against the
    torch sort, including a chunk boundary inside an expert's pairs and a partial last chunk (the cuda tier runs
    1024-pair chunks)."""
    _check_align_kernel(_routing(t, e, k, seeded(6))[1], e, bm, force="chunked", chunk=chunk)


def _check_align_kernel(ids: torch.Tensor, e: int, bm: int, force: str = "kernel", chunk: int = 1024) -> None:
    """The align kernel against the stable torch sort (an independent formulation) on the same ids."""
    got = align_routing(ids, e, bm, force=force, chunk=chunk)
    want = align_routing(ids, e, bm, force="torch")
    counts = torch.bincount(ids.flatten().long(), minlength=e).int()
    assert torch.equal(got.expert_count.cpu(), counts.cpu())
    used = int(((counts + bm - 1) // bm).sum())  # blocks with an expert
    assert int(got.num_blocks) == int(want.num_blocks) == used
    assert bool((got.block_expert[:used] >= 0).all()) and bool((got.block_expert[used:] < 0).all())
    assert torch.equal(got.expert_start, want.expert_start)
    assert torch.equal(got.block_expert, want.block_expert)
    assert not got.work.any() and not want.work.any()  # the dynamic schedule's counters start at zero
    for ex in range(e):
        s, c = int(got.expert_start[ex]), int(got.expert_count[ex])
        assert torch.equal(got.sorted_pairs[s:s + c], want.sorted_pairs[s:s + c]), f"expert {ex}"
        assert bool((ids.flatten()[got.sorted_pairs[s:s + c].long()] == ex).all())


def test_moe_align_default_path() -> None:
    """The single program up to 1024 pairs (K3 T <= 64), the chunked kernels beyond, torch past 1024 experts."""
    assert align_path(1024, 896) == "kernel" and align_path(1025, 896) == "chunked"
    assert align_path(1, 1024) == "kernel" and align_path(1, 1025) == "torch"


def test_moe_align_kernel_refuses_routings_it_cannot_hold() -> None:
    ids = torch.zeros(1025, 1, dtype=torch.int32)  # one pair past SMALL_PAIRS
    with pytest.raises(ValueError, match="1024 pairs"):
        align_routing(ids, 896, 16, force="kernel")
    with pytest.raises(ValueError, match="1024 experts"):
        align_routing(torch.zeros(1, 1, dtype=torch.int32), 1025, 16, force="kernel")
    with pytest.raises(ValueError, match="1024 experts"):
        align_routing(torch.zeros(1, 1, dtype=torch.int32), 1025, 16, force="chunked")
    with pytest.raises(ValueError, match="chunk must be"):
        align_routing(ids, 896, 16, force="chunked", chunk=100)
    with pytest.raises(ValueError, match="force must be"):
        align_routing(ids, 896, 16, force="sort")


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 4, 16, 64], ids=lambda t: f"T{t}")
def test_moe_align_kernel_matches_sort_cuda(t: int) -> None:
    """K3 routings (896 experts, top-16, 16-row blocks) on the GPU, where tl.histogram / tl.sort / tl.gather
    lower differently from the interpreter."""
    ids = _routing(t, 896, 16, seeded(40 + t))[1].cuda()
    _check_align_kernel(ids, 896, 16)


@pytest.mark.cuda
@pytest.mark.parametrize("t,bm", [(65, 16), (512, 16), (1024, 32), (2048, 64), (8192, 64)], ids=lambda v: str(v))
def test_moe_align_chunked_kernels_match_sort_cuda(t: int, bm: int) -> None:
    """K3 routings past the single program (896 experts, top-16: 2 to 128 chunks of 1024 pairs, the first with a
    partial last chunk) on the GPU."""
    ids = _routing(t, 896, 16, seeded(50 + t))[1].cuda()
    _check_align_kernel(ids, 896, bm, force="chunked")


# (activation, act_quant, fp8 variant, x dtype, tiles): the persistent MMA GEMM in the interpreter (portable decode)
_MOE_CASES = [
    ("situ", "bf16", None, torch.bfloat16, MoEConfig()),
    ("silu", "bf16", None, torch.bfloat16, MoEConfig(block_m=32, split_k=2)),
    ("situ", "mxfp8", "ocp", torch.float32, MoEConfig(split_k=4)),
    ("situ", "mxfp8", "fnuz", torch.bfloat16, MoEConfig(block_k=256)),  # w13 (K 256) steps by 256, w2 by 128
    ("situ", "bf16", None, torch.bfloat16, MoEConfig(dynamic=True, split_k=2)),  # items from the atomic counter
    ("situ", "mxfp8", "ocp", torch.bfloat16, MoEConfig(block_m=128, programs_per_sm=1, max_registers=None)),  # prefill
]


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("act,aq,fp8,dtype,cfg", _MOE_CASES,
                         ids=["situ-A16W4", "silu-A16W4-bm32-split2", "situ-A8W4-ocp-split4", "situ-A8W4-fnuz-bk256",
                              "situ-A16W4-dynamic-split2", "situ-A8W4-ocp-bm128"])
def test_fused_moe_interpret(act: str, aq: str, fp8: str | None, dtype: torch.dtype, cfg: MoEConfig) -> None:
    """Prepared MXFP4 experts (K 96, or 256 with block_k 256, and N 64: padded layout tiles) against the reference
    (which reads the same prepared weights). Tolerances: bf16 outputs 1.5e-2 (the bf16 intermediate of A16W4 and
    the interpreter's truncating fp32 -> bf16 cast of the output; measured 5.8e-3 and 3.6e-3), A8W4 with fp32 x
    1e-5 (both sides quantise x and the activation with the same MXFP8 rule; measured 0)."""
    g = seeded(5)
    t, k, e, hidden, n, kout = 5, 2, 4, 256 if cfg.block_k == 256 else 96, 64, 96
    weights = prepare_weights(_mxfp4_experts(e, n, hidden, kout, g))
    assert not weights.has_checkpoint_tensors
    tw, ids = _routing(t, e, k, g)
    x = _randn(t, hidden, gen=g, dtype=dtype)
    kw = dict(activation=MoEActivation(act), act_quant=aq, fp8_dtype=FP8.get(fp8))
    out = fused_moe_with(x, weights, tw, ids, config=cfg, **kw)
    assert out.dtype == x.dtype
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert_rel(out, fused_moe_reference(x, weights, tw, ids, **kw), tol, "fused_moe")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("fmt,act", [("mxfp4", "situ"), ("mxfp4", "silu"), ("bf16", "situ"), ("bf16", "silu")],
                         ids=["mxfp4-situ", "mxfp4-silu", "bf16experts-situ", "bf16experts-silu"])
def test_fused_moe_fp32_operands_interpret(fmt: str, act: str) -> None:
    """fp32 x, A16W4 / bf16 experts: both GEMMs on fp32 operands (IEEE dots, fp32 intermediate) vs the fp32
    reference. Tolerance 1e-5 relative (measured 3.7e-7: summation order and the tanh/sigmoid rounding only)."""
    g = seeded(18)
    t, k, e, hidden, n, kout = 5, 2, 4, 96, 64, 96  # hidden 96: a partial K step
    if fmt == "mxfp4":
        weights = _mxfp4_experts(e, n, hidden, kout, g)
    else:
        weights = ExpertWeights("bf16", _randn(e, 2 * n, hidden, gen=g, scale=0.1, dtype=torch.bfloat16), None,
                                _randn(e, kout, n, gen=g, scale=0.1, dtype=torch.bfloat16), None)
    prepared = prepare_weights(weights)
    tw, ids = _routing(t, e, k, g)
    x = _randn(t, hidden, gen=g)
    kw = dict(activation=MoEActivation(act))
    out = fused_moe_with(x, prepared, tw, ids, config=MoEConfig(split_k=2), **kw)
    assert out.dtype == torch.float32
    assert_rel(out, fused_moe_reference(x, weights, tw, ids, **kw), 1e-5, f"fused_moe fp32 {fmt} {act}")


@pytest.mark.interpret
@needs_interp
def test_fused_moe_extreme_scales_interpret() -> None:
    """E8M0 bytes 0, 1, 130 and 200 (2^-127 .. 2^73) decode exactly (scales above 128 turn the fold off: the
    layout records it); checkpoint scales stay below 127. A8W4 with fp32 x: 1e-5 relative."""
    g = seeded(16)
    t, k, e, hidden, n, kout = 3, 2, 3, 128, 64, 128
    weights = _mxfp4_experts(e, n, hidden, kout, g)
    weights.w13_scale[0, :2] = 200
    weights.w13_scale[1, 3:6] = 1
    weights.w13_scale[2, 0] = 0
    weights.w2_scale[1, :2] = 130
    prepared = prepare_weights(weights)
    assert not prepared.extras["triton"].fold13 and not prepared.extras["triton"].fold2
    tw, ids = _routing(t, e, k, g)
    x = _randn(t, hidden, gen=g)
    kw = dict(activation=MoEActivation("silu"), act_quant="mxfp8", fp8_dtype=torch.float8_e4m3fn)
    out = fused_moe_with(x, prepared, tw, ids, **kw)
    assert_rel(out, fused_moe_reference(x, weights, tw, ids, **kw), 1e-5, "fused_moe extreme scales")


@pytest.mark.interpret
@needs_interp
def test_fused_moe_lazy_prepare_interpret() -> None:
    """Checkpoint-layout MXFP4 weights given straight to the kernel are prepared once and cached in extras."""
    g = seeded(19)
    weights = _mxfp4_experts(3, 64, 128, 128, g)
    tw, ids = _routing(2, 3, 2, g)
    x = _randn(2, 128, gen=g, dtype=torch.bfloat16)
    out = fused_moe_with(x, weights, tw, ids)
    cached = weights.extras["triton-prepared"]
    assert cached.layout == "triton" and weights.has_checkpoint_tensors
    assert fused_moe_with(x, weights, tw, ids) is not None and weights.extras["triton-prepared"] is cached
    assert_rel(out, fused_moe_reference(x, weights, tw, ids), 1.5e-2, "lazily prepared")


def test_prepare_weights_and_supports() -> None:
    g = seeded(17)
    weights = _mxfp4_experts(2, 32, 64, 64, g)
    prepared = prepare_weights(weights)
    assert prepared.layout == "triton" and prepare_weights(prepared) is prepared  # idempotent
    assert prepared.w13 is None and prepared.extras["triton"].w13.shape == (2, 2, 1, 2, 128, 16)  # N 32 -> 64 rows
    tw, ids = _routing(1, 2, 1, g)
    x = torch.zeros(1, 64)
    assert fused_moe_supports(x, weights, tw, ids) == (True, "supported")  # checkpoint layout: prepared lazily
    assert fused_moe_supports(x, weights, tw, ids, act_quant="mxfp8")[0] is False  # fp8_dtype missing
    dense = ExpertWeights("bf16", torch.zeros(2, 64, 64).transpose(1, 2).contiguous().transpose(1, 2), None,
                          torch.zeros(2, 64, 32), None)
    assert not dense.w13.is_contiguous() and prepare_weights(dense).w13.is_contiguous()
    with pytest.raises(TypeError, match="ExpertWeights"):
        prepare_weights(weights.w13)


@pytest.mark.parametrize("bad", [dict(block_m=8), dict(block_m=24), dict(block_k=64), dict(num_warps=8),
                                 dict(num_stages=0), dict(split_k=0), dict(max_registers=300)],
                         ids=["BM8", "BM24", "BK64", "warps8", "stages0", "split0", "regs300"])
def test_moe_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError, match="MoEConfig"):
        MoEConfig(**bad)


@pytest.mark.parametrize("bad", [dict(block_m=48), dict(stages=1), dict(ctas_per_sm=0), dict(producer_regs=30),
                                 dict(max_registers=256), dict(ctas_per_sm=4), dict(stages=8), dict(tile_rows=192),
                                 dict(block_m=64, max_registers=128, ctas_per_sm=2, tile_rows=256),
                                 dict(block_m=128, ctas_per_sm=1, max_registers=248, tile_rows=256)],
                         ids=["BM48", "stages1", "ctas0", "regs30", "maxreg256", "regfile", "shared", "tile192",
                              "shared256", "acc256"])
def test_ws_config_validation(bad: dict) -> None:
    """The Hopper kernel's WsConfig: bad fields, and residencies the SM's 65536 registers (4 CTAs x 256 threads x
    80) or 227 KB of shared memory (8 stages x 3 CTAs) cannot hold, and 256-row tiles at 128-row blocks (four
    [64, 128] fp32 accumulators: 256 registers per consumer thread, spilled), are ValueErrors naming the config."""
    from rocm_k3.triton_kernels.moe import gemm_hopper

    with pytest.raises(ValueError, match="WsConfig"):
        gemm_hopper.WsConfig(**bad)
    with pytest.raises(TypeError, match="WsConfig.pdl"):
        gemm_hopper.WsConfig(pdl=1)
    assert gemm_hopper.default_config(64).shared_bytes() * 2 <= gemm_hopper.SHARED_PER_SM
    for bm in (32, 64):  # the 256-row weight tiles' residencies fit, and bm16 (decode) has none
        wide = gemm_hopper.wide_config(bm)
        assert wide.groups == 4 and wide.shared_bytes() * wide.ctas_per_sm <= gemm_hopper.SHARED_PER_SM
    with pytest.raises(ValueError, match="256-row"):
        gemm_hopper.wide_config(16)
    c = gemm_hopper.default_config(16)  # w2's K parts: T = 1 on K3 (16 blocks x 28 tiles on 396 CTAs) -> 4
    assert gemm_hopper.w2_parts(c, 16 * 28, 396, 24) == 4 and gemm_hopper.w2_parts(c, 8 * 396, 396, 24) == 1
    with pytest.raises(ValueError, match="w2_split 3"):
        gemm_hopper.w2_parts(dataclasses.replace(c, w2_split=3), 100, 396, 4)
    with pytest.raises(ValueError, match="16-, 32-, 64- or 128-row"):
        gemm_hopper.default_config(256)
    assert gemm_hopper.default_config(128).shared_bytes() <= gemm_hopper.SHARED_PER_SM
    assert [gemm_hopper.producer_warps(bm) for bm in gemm_hopper.BLOCK_SIZES] == [1, 2, 4, 4]


def test_ws_config_pair_validation() -> None:
    """``fused_moe_with(ws_config=...)`` takes one WsConfig (both GEMMs) or a (w13, w2) pair: anything else is a
    TypeError, a pair whose GEMMs launch differently (pdl) or whose block size is not the routing's a ValueError, all
    before any kernel runs (CPU)."""
    from rocm_k3.triton_kernels.moe import gemm_hopper

    g = seeded(31)
    weights = prepare_weights(_mxfp4_experts(4, 64, 64, 64, g, "cpu"))
    tw, ids = _routing(4, 4, 2, g, "cpu")
    x = _randn(4, 64, gen=g, dtype=torch.bfloat16)
    bm16, wide = gemm_hopper.default_config(16), gemm_hopper.wide_config(32)
    for bad in ((bm16,), (bm16, bm16, bm16), (bm16, "w2"), [bm16, bm16], MoEConfig()):
        with pytest.raises(TypeError, match="ws_config must be"):
            fused_moe_with(x, weights, tw, ids, ws_config=bad)
    with pytest.raises(ValueError, match="pdl"):
        fused_moe_with(x, weights, tw, ids, ws_config=(bm16, dataclasses.replace(bm16, pdl=False)))
    with pytest.raises(ValueError, match=r"ws_config.block_m \(16/32\)"):  # T = 4 x 2 pairs: 16-row blocks
        fused_moe_with(x, weights, tw, ids, ws_config=(bm16, wide))


def test_moe_config_dynamic_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="MoEConfig.dynamic"):
        MoEConfig(dynamic=1)


def test_moe_pick_config() -> None:
    """K3 (896 experts, top-16): 16-row blocks at decode, no K split, dynamic items from T = 4; 32 / 64-row blocks
    as rows per expert grow."""
    assert pick_config(16, 896) == MoEConfig(block_m=16, split_k=1, dynamic=False)  # T = 1
    assert pick_config(4 * 16, 896) == MoEConfig(block_m=16, dynamic=True)  # T = 4
    assert pick_config(64 * 16, 896) == MoEConfig(block_m=16, dynamic=True)  # T = 64: ~1.1 rows per used expert
    assert pick_config(1024 * 16, 896).block_m == 32  # ~18 rows per expert
    prefill = pick_config(2048 * 16, 896)  # ~37 rows per expert
    assert (prefill.block_m, prefill.programs_per_sm, prefill.max_registers) == (64, 2, None)
    assert pick_config(8192 * 16, 896).block_m == 64  # ~146 rows per expert: three 64-row blocks beat two of 128


def test_launcher_argument_errors() -> None:
    q = torch.zeros(1, 2, 512)
    args = (q, torch.zeros(1, 2, 64), torch.zeros(1, 16, 576), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="splits"):
        mla_decode_with(*args, scale=0.1, splits=0)
    with pytest.raises(ValueError, match="block_h"):
        mla_decode_with(*args, scale=0.1, block_h=12)
    w = prepare_weights(_mxfp4_experts(2, 32, 32, 32, seeded(17)))
    tw, ids = _routing(1, 2, 1, seeded(17))
    with pytest.raises(TypeError, match="MoEConfig"):
        fused_moe_with(torch.zeros(1, 32), w, tw, ids, config=(16, 128, 4, 3))
    with pytest.raises(ValueError, match="decode"):
        fused_moe_with(torch.zeros(1, 32), w, tw, ids, decode="lut")
    with pytest.raises(ValueError, match="NVIDIA"):
        fused_moe_with(torch.zeros(1, 32), w, tw, ids, decode="asm")  # CPU tensors: no inline PTX
    with pytest.raises(ValueError, match="gemm must be"):
        fused_moe_with(torch.zeros(1, 32), w, tw, ids, gemm="gluon")
    with pytest.raises(ValueError, match="gemm='ws'.*NVIDIA"):
        fused_moe_with(torch.zeros(1, 32), w, tw, ids, gemm="ws")  # CPU tensors: no Hopper kernel
    with pytest.raises(ValueError, match="act_math"):
        fused_moe_with(torch.zeros(1, 32), w, tw, ids, act_math="exact")
    with pytest.raises(ValueError, match="act_math='fast'.*NVIDIA"):
        fused_moe_with(torch.zeros(1, 32), w, tw, ids, act_math="fast")


@pytest.mark.interpret
@pytest.mark.skipif(_INTERPRETED or torch.cuda.is_available(),
                    reason="the interpreter tier ran in this process (or a GPU is present)")
def test_interpret_tier_in_subprocess() -> None:
    run_interpret_tier(__file__)


def test_compile_kernel_argument_errors() -> None:
    from rocm_k3.triton_kernels.compile_check import compile_kernel

    kernel = tri_norm._rms_norm_kernel
    with pytest.raises(ValueError, match="missing arguments"):
        compile_kernel(kernel, {"x_ptr": "*fp32"}, {}, "sm_90")
    with pytest.raises(ValueError, match="not arguments"):
        compile_kernel(kernel, {"nope": "i32"}, {}, "sm_90")
    with pytest.raises(TypeError, match="mapping"):
        compile_kernel(kernel, ["x_ptr"], {}, "sm_90")


@pytest.mark.interpret
@needs_interp
def test_compile_kernel_refuses_an_interpreted_process() -> None:
    from rocm_k3.triton_kernels.compile_check import compile_kernel

    sig = {a: "i32" for a in tri_norm._rms_norm_kernel.arg_names}
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_kernel(tri_norm._rms_norm_kernel, sig, {}, "gfx942")


# --------------------------------------------------------------------------------------------------- compile tier
_COMPILE_KERNELS = ("rms_norm", "attn_res_step", "mla_decode", "mla_prefill", "mla_prefill_expanded",
                    "mla_decode_r48_p24", "mla_prefill_r48_p24", "varlen_attention", "moe_route", "moe_align",
                    "moe_align_t1", "moe_align_count", "moe_align_scan", "moe_align_scatter", "moe_w13_a16w4",
                    "moe_w2_a16w4_split", "moe_w13_dynamic", "moe_w2_dynamic", "moe_w13_a8w4", "moe_w2_two_mul",
                    "moe_w13_prefill", "moe_w13_f32", "moe_w2_bf16experts", "moe_w2_f32_bf16experts",
                    "moe_topk_reduce", "moe_mxfp8_round_trip")
_MMA_KERNELS = ("mla_decode", "mla_prefill", "mla_prefill_expanded", "mla_decode_r48_p24", "mla_prefill_r48_p24",
                "varlen_attention", "moe_w13_a16w4", "moe_w2_a16w4_split", "moe_w13_dynamic", "moe_w2_dynamic",
                "moe_w13_a8w4", "moe_w2_two_mul", "moe_w13_prefill", "moe_w2_bf16experts")
# compiled as programmatic dependent launches on sm_90 (fused_moe_with launches them so on sm_90+)
_PDL_KERNELS = ("moe_align", "moe_topk_reduce")
# fp32-operand MoE GEMMs (input_precision="ieee"): fp32 FMAs on sm_90 (no TF32 / bf16 mma), fp32 MFMAs on AMD
_F32_DOT_KERNELS = ("moe_w13_f32", "moe_w2_f32_bf16experts")
# MXFP4 GEMMs with the inline-PTX decode on sm_90: bf16x2 multiplies per 128-weight step of a thread (4 per word; 8
# for the two-multiply decode of scales > 128), cp.async pipelining, the static SASS of the K loop per weight
# element (128 x BK weights over 128 threads per step) within budget, no local memory, no layout shuffles.
# kernel -> (HMUL2 in the K loop, SASS per weight budget). Measured (2026-12-01, the 9-op decode) with Triton 3.9:
# 2.77-2.80 per weight for the one-multiply decode tiles (358 per step for moe_w13_a16w4; 367 with Triton 3.6),
# 3.63 two-multiply, 3.31 at prefill tiles (64-row blocks: 8 gathered 16-byte activation loads per thread and step)
_ASM_DECODE_KERNELS = {"moe_w13_a16w4": (64, 3.0), "moe_w2_a16w4_split": (64, 3.0), "moe_w13_dynamic": (64, 3.0),
                       "moe_w2_dynamic": (64, 3.0), "moe_w13_a8w4": (64, 3.0),
                       "moe_w2_two_mul": (128, 3.8), "moe_w13_prefill": (64, 3.5)}


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_driver("triton_compile_driver.py")


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90", "gfx942", "gfx950"])
@pytest.mark.parametrize("kernel", _COMPILE_KERNELS)
def test_kernels_compile(compiled: dict, kernel: str, target: str) -> None:
    res = compiled[f"{kernel}/{target}"]
    assert res["ok"], res["error"]
    mnemonics = res["mnemonics"]
    if kernel in _MMA_KERNELS:
        if target == "sm_90":
            assert any(m.startswith(("wgmma.mma_async", "mma.sync")) for m in mnemonics), mnemonics
        else:
            assert any(m.startswith("v_mfma") for m in mnemonics), [m for m in mnemonics if "mfma" in m]
    if kernel in _PDL_KERNELS and target == "sm_90":  # they wait for the kernel before on the device
        assert "griddepcontrol.wait" in mnemonics, mnemonics
    if kernel in _F32_DOT_KERNELS:
        if target == "sm_90":
            assert not any("mma" in m for m in mnemonics) and "fma.rn.f32" in mnemonics, mnemonics
        else:
            mfma = [m for m in mnemonics if m.startswith("v_mfma")]
            assert mfma and all(m.endswith("_f32") and "xf32" not in m for m in mfma), mfma
    if kernel in _ASM_DECODE_KERNELS and target == "sm_90":
        assert res["scratch"] == 0 and res["spills"] == 0, f"{kernel}: local memory {res}"
        loops = res["sass_loops"]
        if loops is None:
            pytest.skip("no cuobjdump to read the SASS")
        k_loop = next(lp for lp in loops if lp["opcodes"].get("HGMMA"))  # the innermost loop with the MMA
        hmul2, budget = _ASM_DECODE_KERNELS[kernel]
        assert k_loop["opcodes"].get("HMUL2") == hmul2 and k_loop["opcodes"].get("LDGSTS"), k_loop
        per_weight = k_loop["instructions"] / 128
        assert per_weight <= budget, f"{kernel}: {per_weight:.2f} SASS per weight {k_loop}"
        assert not {"STS", "SHFL", "LDL", "STL"} & set(k_loop["opcodes"]), f"{kernel}: layout shuffles {k_loop}"
    if kernel.startswith("moe_w13") and target == "sm_90":  # the SiTU epilogue's sigmoids on MUFU ex2 / rcp
        fast = {"ex2.approx.ftz.f32", "rcp.approx.ftz.f32"}
        assert fast <= set(mnemonics), sorted(m for m in mnemonics if "f32" in m)
    if target != "sm_90":
        assert res["scratch"] == 0, f"{kernel} on {target} uses {res['scratch']} B of scratch (register spills)"


@pytest.fixture(scope="module")
def compiled_hopper() -> dict:
    return run_compile_driver("hopper_compile_driver.py")


@pytest.mark.compile
@pytest.mark.parametrize("variant", ["ws_w13", "ws_w13_mx", "ws_w2", "ws_w13_bm32", "ws_w13_bm64", "ws_w2_bm64",
                                     "ws_w2_split2", "ws_w13_bm128", "ws_w2_bm128", "ws_w13_bm64_t256",
                                     "ws_w2_bm64_t256", "ws_w13_bm32_t256", "ws_w2_bm32_t256"])
def test_hopper_ws_gemm_compiles(compiled_hopper: dict, variant: str) -> None:
    """The warp-specialised Hopper MoE GEMM (.moe.gemm_hopper) for sm_90 at each block size's default config: TMA
    loads, setmaxnreg, programmatic-dependent-launch waits, wgmma (N = the block's rows) with the decoded weights
    as the register A operand; its consumer K loop (two 64-row groups x 128 K per thread step) carries the 64
    bf16x2 scale multiplies, no local memory or shuffles, wgmma chains not serialised by ptxas (a serialised loop
    waits after each of its 16 wgmma: 32 WARPGROUP instructions; the overlapped one has 4), and at most 2.6 SASS
    per weight (306-312 per 128 weights measured with Triton 3.6 and 3.9); the shared memory WsConfig budgets
    covers what the kernel declares. 256-row weight tiles (``_t256``, four groups) double the loop's decode and
    wgmma (562-567 SASS per 256 weights with Triton 3.9)."""
    res = compiled_hopper[variant]
    assert res["ok"], res["error"]
    mnemonics = set(res["mnemonics"])
    assert {"cp.async.bulk.tensor.3d.shared", "setmaxnreg.inc.sync.aligned.u32", "griddepcontrol.wait"} <= mnemonics, \
        sorted(mnemonics)
    n = res["block_m"]
    assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in mnemonics and res["register_a"], variant
    assert res["shared"] <= res["shared_estimate"], res
    loops = res["sass_loops"]
    if loops is None:
        pytest.skip("no cuobjdump to read the SASS")
    k_loop = next(lp for lp in loops if lp["opcodes"].get("HGMMA"))  # the innermost loop with the MMA
    groups = res["groups"]  # 64-row weight groups per item: 128 weights per thread and step each 2
    assert k_loop["opcodes"].get("HMUL2") == 32 * groups and k_loop["opcodes"].get("HGMMA") == 8 * groups, k_loop
    assert not {"LDL", "STL", "STS", "SHFL"} & set(k_loop["opcodes"]), k_loop
    assert k_loop["opcodes"].get("WARPGROUP", 0) <= 8, f"serialised wgmma: {k_loop}"
    assert k_loop["instructions"] / (64 * groups) <= 2.6, k_loop


# ------------------------------------------------------------------------------------------------------ cuda tier
def _k3_experts(e: int = 896) -> ExpertWeights:
    """K3 LatentMoE experts (E x (3584 -> 2 x 3072 -> 3584)), random MXFP4 bytes, checkpoint-like scales."""
    k, n = 3584, 3072
    gd = torch.Generator(device="cuda").manual_seed(10)
    w13 = torch.randint(0, 256, (e, 2 * n, k // 2), dtype=torch.uint8, device="cuda", generator=gd)
    w2 = torch.randint(0, 256, (e, k, n // 2), dtype=torch.uint8, device="cuda", generator=gd)
    s13 = torch.randint(118, 123, (e, 2 * n, k // 32), dtype=torch.uint8, device="cuda", generator=gd)
    s2 = torch.randint(118, 123, (e, k, n // 32), dtype=torch.uint8, device="cuda", generator=gd)
    return ExpertWeights("mxfp4", w13, s13, w2, s2)


@pytest.fixture(scope="module")
def k3_moe() -> tuple[ExpertWeights, ExpertWeights]:
    """(checkpoint, prepared) K3 experts on the GPU, made once for the module."""
    weights = _k3_experts()
    return weights, prepare_weights(weights)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 4, 16, 64, 512, 2048], ids=lambda t: f"T{t}")
def test_fused_moe_k3_cuda(t: int, k3_moe) -> None:
    """K3 experts, top-16, bf16 x, A16W4 and A8W4 (OCP and FNUZ e4m3) against the reference on the checkpoint
    tensors. Tolerances: A16W4 5e-3 (the bf16 intermediate and output roundings; 2.6e-3 measured for the previous
    kernels), A8W4 1e-2 (an MXFP8 rounding of the intermediate can flip with the summation order). The portable
    Triton decode must give the same bits as the inline PTX (identical MMA inputs); the portable epilogue math
    must agree with the fast one within 2e-3 (they differ by a few fp32 ulp before the bf16 rounding of the
    intermediate, which then flips by one bf16 ulp at most in a few values)."""
    weights, prepared = k3_moe
    g = seeded(10)
    tw, ids = _routing(t, weights.num_experts, 16, g, "cuda")
    x = _randn(t, weights.hidden, gen=g, device="cuda", dtype=torch.bfloat16)
    ref = fused_moe_reference(x, weights, tw, ids, activation=MoEActivation())
    out = fused_moe_with(x, prepared, tw, ids)
    assert_rel(out, ref, 5e-3, "A16W4")
    out_triton = fused_moe_with(x, prepared, tw, ids, gemm="triton")
    # on the H200 the default is the warp-specialised Hopper kernel (16- to 128-row blocks): the same decode
    # and epilogue math as moe_gemm_kernel, outputs apart only by the MMA's fp32 summation order
    assert_rel(out, out_triton, 1e-3, "ws vs moe_gemm_kernel")
    if t <= 64:
        assert torch.equal(fused_moe_with(x, prepared, tw, ids, decode="portable"), out_triton), "asm vs portable"
    if t in (1, 2048):  # the fast epilogue math (default on NVIDIA) vs the portable one: a few fp32 ulp apart
        assert_rel(fused_moe_with(x, prepared, tw, ids, act_math="portable"), out, 2e-3, "portable epilogue")
    for fp8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) if t in (1, 64, 2048) else (torch.float8_e4m3fn,):
        kw = dict(activation=MoEActivation(), act_quant="mxfp8", fp8_dtype=fp8)
        assert_rel(fused_moe_with(x, prepared, tw, ids, **kw), fused_moe_reference(x, weights, tw, ids, **kw),
                   1e-2, f"A8W4 {fp8}")


def _assert_graph_replays(prepared: ExpertWeights, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor, e: int,
                          seeds: tuple[int, ...], **kw) -> None:
    """fused_moe_with(**kw) captured in a CUDA graph replays the eager result for new routings of ids' shape."""
    static = [x.clone(), tw.clone(), ids.clone()]
    fused_moe_with(static[0], prepared, static[1], static[2], **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_with(static[0], prepared, static[1], static[2], **kw)
    for seed in seeds:
        tw2, ids2 = _routing(ids.shape[0], e, ids.shape[1], seeded(seed), "cuda")
        static[1].copy_(tw2)
        static[2].copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fused_moe_with(x, prepared, tw2, ids2, **kw)), f"graph replay (seed {seed})"


@pytest.mark.cuda
def test_fused_moe_ws_gemm_graph_and_fallback_cuda() -> None:
    """The warp-specialised Hopper GEMMs (``gemm="ws"``), A16W4 and A8W4, against the reference (5e-3 / 1e-2 as
    above) and captured in a CUDA graph (replays equal the eager result for new routings), at 16-, 32-, 64- and
    128-row blocks, with and without programmatic dependent launch, w2 in 1, 2 and 4 K parts; where they do not apply
    (a scale byte > 128, fp32 x) a forced ``gemm="ws"`` is a ValueError naming why, and the default runs that GEMM
    on ``moe_gemm_kernel`` (checked against the reference). 256-row weight tiles (``wide_config``) give the
    128-row tiles' bits at 32 / 64-row blocks (w2 in one K part), also as w2's tiles only (a (w13, w2) config
    pair), and match the reference where the last tile is half outside."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised GEMM is sm_90 only")
    g = seeded(23)
    e, n, hidden, t = 64, 512, 1024, 8
    weights = _mxfp4_experts(e, n, hidden, hidden, g, "cuda")
    prepared = prepare_weights(weights)
    tw, ids = _routing(t, e, 8, g, "cuda")
    x = _randn(t, hidden, gen=g, device="cuda", dtype=torch.bfloat16)
    out = fused_moe_with(x, prepared, tw, ids, gemm="ws")
    assert_rel(out, fused_moe_reference(x, weights, tw, ids), 5e-3, "ws A16W4")
    kw = dict(act_quant="mxfp8", fp8_dtype=torch.float8_e4m3fn)
    assert_rel(fused_moe_with(x, prepared, tw, ids, gemm="ws", **kw), fused_moe_reference(x, weights, tw, ids, **kw),
               1e-2, "ws A8W4")
    _assert_graph_replays(prepared, x, tw, ids, e, (24, 25), gemm="ws")
    # the prefill blocks (32 / 64 / 128 rows, 2 / 4 / 4 producer warps) and the launch without PDL: the same bits
    from rocm_k3.triton_kernels.moe import gemm_hopper

    t2 = 192  # 24 pairs per expert on average: partly filled 32- and 64-row blocks, two 16-row blocks
    tw2, ids2 = _routing(t2, e, 8, g, "cuda")
    x2 = _randn(t2, hidden, gen=g, device="cuda", dtype=torch.bfloat16)
    ref2 = fused_moe_reference(x2, weights, tw2, ids2)
    for bm in gemm_hopper.BLOCK_SIZES:
        cfg = dataclasses.replace(pick_config(t2 * 8, e), block_m=bm)
        ws = gemm_hopper.default_config(bm)
        out_bm = fused_moe_with(x2, prepared, tw2, ids2, gemm="ws", config=cfg, ws_config=ws)
        assert_rel(out_bm, ref2, 5e-3, f"ws A16W4 bm{bm}")
        no_pdl = fused_moe_with(x2, prepared, tw2, ids2, gemm="ws", config=cfg,
                                ws_config=dataclasses.replace(ws, pdl=False))
        assert torch.equal(out_bm, no_pdl), f"bm{bm}: PDL vs plain launch"
        assert_rel(fused_moe_with(x2, prepared, tw2, ids2, gemm="ws", config=cfg, ws_config=ws, **kw),
                   fused_moe_reference(x2, weights, tw2, ids2, **kw), 1e-2, f"ws A8W4 bm{bm}")
        _assert_graph_replays(prepared, x2, tw2, ids2, e, (26,), gemm="ws", config=cfg, ws_config=ws)
        if bm in (32, 64):  # 256-row weight tiles (four accumulators): the same sums per output, the same bits
            wide = gemm_hopper.wide_config(bm)
            out_wide = fused_moe_with(x2, prepared, tw2, ids2, gemm="ws", config=cfg, ws_config=wide)
            assert_rel(out_wide, ref2, 5e-3, f"ws A16W4 bm{bm} 256-row tiles")
            one = [fused_moe_with(x2, prepared, tw2, ids2, gemm="ws", config=cfg,
                                  ws_config=dataclasses.replace(c, w2_split=1)) for c in (ws, wide)]
            assert torch.equal(one[0], one[1]), f"bm{bm}: 256- vs 128-row weight tiles (w2 in one K part)"
            mixed = (ws, dataclasses.replace(wide, w2_split=1))  # per GEMM: w13 on 128-row tiles, w2 on 256
            fresh = prepare_weights(weights)  # its TMA descriptors say which GEMM ran with which tile (the bits can't)
            assert torch.equal(fused_moe_with(x2, fresh, tw2, ids2, gemm="ws", config=cfg, ws_config=mixed),
                               one[0]), f"bm{bm}: w13 128 / w2 256-row tiles vs 128 for both"
            assert {key for key in fresh.extras if key.startswith("triton-ws")} == {"triton-ws1-2", "triton-ws2-4"}
            _assert_graph_replays(prepared, x2, tw2, ids2, e, (29,), gemm="ws", config=cfg, ws_config=(ws, wide))
            assert_rel(fused_moe_with(x2, prepared, tw2, ids2, gemm="ws", config=cfg, ws_config=wide, **kw),
                       fused_moe_reference(x2, weights, tw2, ids2, **kw), 1e-2, f"ws A8W4 bm{bm} 256-row tiles")
            _assert_graph_replays(prepared, x2, tw2, ids2, e, (28,), gemm="ws", config=cfg, ws_config=wide)
    # an odd count of 128-row w2 tiles (Kout 384): the last 256-row item reads the next expert's rows (or past the
    # last expert: TMA zero fill) for outputs >= Kout, which are masked
    odd = _mxfp4_experts(16, 256, 384, 384, g, "cuda")
    tw3, ids3 = _routing(64, 16, 4, g, "cuda")
    x3 = _randn(64, 384, gen=g, device="cuda", dtype=torch.bfloat16)
    cfg3 = dataclasses.replace(pick_config(64 * 4, 16), block_m=32)
    assert_rel(fused_moe_with(x3, prepare_weights(odd), tw3, ids3, gemm="ws", config=cfg3,
                              ws_config=gemm_hopper.wide_config(32)),
               fused_moe_reference(x3, odd, tw3, ids3), 5e-3, "ws 256-row tiles, 3 w2 tiles")
    for parts in (2, 4):  # w2 in K parts (the reduce sums them): another fp32 summation order, bf16 output
        ws = dataclasses.replace(gemm_hopper.default_config(16), w2_split=parts)
        out_split = fused_moe_with(x, prepared, tw, ids, gemm="ws", ws_config=ws)
        assert_rel(out_split, fused_moe_reference(x, weights, tw, ids), 5e-3, f"w2 in {parts} K parts")
        assert_rel(out_split, out, 3e-3, f"w2 in {parts} K parts vs one")
    _assert_graph_replays(prepared, x, tw, ids, e, (27,), gemm="ws", ws_config=ws)
    with pytest.raises(ValueError, match="w2_split 3"):  # 4 K steps of 128
        fused_moe_with(x, prepared, tw, ids, gemm="ws",
                       ws_config=dataclasses.replace(gemm_hopper.default_config(16), w2_split=3))
    with pytest.raises(ValueError, match="ws_config.block_m"):
        fused_moe_with(x, prepared, tw, ids, gemm="ws", ws_config=gemm_hopper.default_config(64))
    weights.w2_scale[3, :4] = 130  # two-multiply decode for w2: the default runs w13 on ws and w2 on Triton
    unfolded = prepare_weights(weights)
    with pytest.raises(ValueError, match="w2 GEMM.*128"):
        fused_moe_with(x, unfolded, tw, ids, gemm="ws")
    assert_rel(fused_moe_with(x, unfolded, tw, ids), fused_moe_reference(x, weights, tw, ids), 5e-3, "mixed")
    with pytest.raises(ValueError, match="w13 GEMM"):
        fused_moe_with(x.float(), prepared, tw, ids, gemm="ws")


@pytest.mark.cuda
def test_fused_moe_cuda_graph_and_extreme_scales_cuda() -> None:
    """The op captured in a CUDA graph (no host sync: the used-block count stays on the device) replays the eager
    result for new routings of the same shape; E8M0 bytes 0, 1, 130 and 200 (two-multiply decode) are exact."""
    g = seeded(20)
    e, n, hidden, t = 64, 512, 1024, 8
    weights = _mxfp4_experts(e, n, hidden, hidden, g, "cuda")
    weights.w13_scale[0, :4] = 200
    weights.w13_scale[1, :4] = 1
    weights.w13_scale[2, :4] = 0
    weights.w2_scale[3, :4] = 130
    prepared = prepare_weights(weights)
    tw, ids = _routing(t, e, 8, g, "cuda")
    ids[0, :3] = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    x = _randn(t, hidden, gen=g, device="cuda", dtype=torch.bfloat16)
    ref = fused_moe_reference(x, weights, tw, ids)
    assert_rel(fused_moe_with(x, prepared, tw, ids), ref, 5e-3, "extreme scales")
    _assert_graph_replays(prepared, x, tw, ids, e, (21, 22))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_fused_moe_fp32_operands_cuda(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 x on the GPU: the fp32-operand path (IEEE dots) against the reference with TF32 off, 1e-5 relative."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = seeded(19)
    e, k, hidden, n, t = 64, 8, 1024, 512, 24
    if fmt == "mxfp4":
        weights = _mxfp4_experts(e, n, hidden, hidden, g, "cuda")
    else:
        weights = ExpertWeights("bf16", _randn(e, 2 * n, hidden, gen=g, scale=0.05, device="cuda",
                                               dtype=torch.bfloat16), None,
                                _randn(e, hidden, n, gen=g, scale=0.05, device="cuda", dtype=torch.bfloat16), None)
    prepared = prepare_weights(weights)
    tw, ids = _routing(t, e, k, g, "cuda")
    x = _randn(t, hidden, gen=g, device="cuda")
    for act in (MoEActivation("situ"), MoEActivation("silu")):
        assert_rel(fused_moe_with(x, prepared, tw, ids, activation=act),
                   fused_moe_reference(x, weights, tw, ids, activation=act), 1e-5, f"fp32 {fmt} {act.kind}")


@pytest.mark.cuda
def test_fused_moe_bf16_experts_kimi_linear_cuda() -> None:
    g = seeded(11)
    e, k, hidden, n, t = 256, 8, 2304, 1024, 32
    w13 = _randn(e, 2 * n, hidden, gen=g, scale=0.02, device="cuda", dtype=torch.bfloat16)
    w2 = _randn(e, hidden, n, gen=g, scale=0.02, device="cuda", dtype=torch.bfloat16)
    weights = prepare_weights(ExpertWeights("bf16", w13, None, w2, None))
    tw, ids = _routing(t, e, k, g, "cuda")
    x = _randn(t, hidden, gen=g, device="cuda", dtype=torch.bfloat16)
    act = MoEActivation("silu")
    assert_rel(fused_moe_with(x, weights, tw, ids, activation=act),
               fused_moe_reference(x, weights, tw, ids, activation=act), 1e-2, "bf16 experts")


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 300], ids=lambda t: f"T{t}")
def test_attn_res_k3_cuda(t: int) -> None:
    g = seeded(12)
    hd, b_max, nb = 7168, 9, 8
    p, d = (_randn(t, hd, gen=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    blocks = _randn(b_max, t, hd, gen=g, device="cuda", dtype=torch.bfloat16)
    pw, nw, rw = (_randn(hd, gen=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = dict(write_block=True, proj_weight=pw, norm_weight=nw, rms_weight=rw)
    bk, br = blocks.clone(), blocks.clone()
    ref = ref_attn_res._attn_res_step_reference(p, d, br, nb, **kw)
    for cfg in (None, tri_attn_res.AttnResConfig(1, 8, prefetch=False)):
        bk = blocks.clone()
        out = tri_attn_res.attn_res_step_with(p, d, bk, nb, config=cfg, **kw)
        assert_rel(out.partial, ref.partial, 0.0, "partial")
        assert_rel(bk, br, 0.0, "blocks")
        assert_rel(out.normed, ref.normed, 1e-2, f"normed ({cfg})")


@pytest.mark.cuda
@pytest.mark.parametrize("n,h,length", [(2, 96, 3000), (8, 12, 1000), (64, 12, 257)], ids=lambda v: str(v))
def test_mla_decode_k3_cuda(n: int, h: int, length: int) -> None:
    g = seeded(13)
    bs = 64
    per = (length + bs - 1) // bs
    cache = _randn(n * per, bs, 576, gen=g, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(n * per, generator=g).view(n, per).to(device="cuda", dtype=torch.int32)
    lens = torch.randint(1, length + 1, (n,), generator=g).to(device="cuda", dtype=torch.int32)
    q = _randn(n, h, 512, gen=g, device="cuda", dtype=torch.bfloat16, scale=0.1)
    qpe = _randn(n, h, 64, gen=g, device="cuda", dtype=torch.bfloat16, scale=0.1)
    ref = ref_mla._mla_decode_reference(q, qpe, cache, table, lens, scale=192 ** -0.5)
    for splits in (None, 1):
        out = mla_decode_with(q, qpe, cache, table, lens, scale=192 ** -0.5, splits=splits)
        assert_rel(out, ref, 1e-2, f"mla_decode splits={splits}")


@pytest.mark.cuda
def test_route_activation_prefill_k3_cuda() -> None:
    g = seeded(15)
    logits = _randn(64, 896, gen=g, device="cuda")
    bias = _randn(896, gen=g, scale=0.01, device="cuda")
    got = tri_pointwise.route(logits, 16, correction_bias=bias)
    want = route_reference(logits, 16, correction_bias=bias)
    assert torch.equal(got.ids, want.ids)
    assert_rel(got.weights, want.weights, 1e-6, "route weights")
    ties = torch.randint(-1, 2, (64, 896), generator=g).float().cuda()  # exact ties: the lower index wins
    for b in (None, (bias > 0).float() * 0.25 - 0.9):
        got, want = tri_pointwise.route(ties, 16, correction_bias=b), route_reference(ties, 16, correction_bias=b)
        assert torch.equal(got.ids, want.ids)
        assert_rel(got.weights, want.weights, 1e-6, "route weights, ties")
    h = _randn(64, 2 * 3072, gen=g, scale=4.0, device="cuda", dtype=torch.bfloat16)
    assert_rel(tri_pointwise.situ_and_mul(h), situ_and_mul_reference(h), 1e-2, "situ_and_mul")
    heads, bs = 12, 64
    lens = torch.tensor([700, 130], dtype=torch.int32)
    cu = torch.tensor([0, 300, 430], dtype=torch.int32)  # 300 new of 700, all 130 new
    per = 11
    cache = _randn(2 * per, bs, 576, gen=g, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(2 * per, generator=g).view(2, per).to(device="cuda", dtype=torch.int32)
    q = _randn(430, heads, 192, gen=g, device="cuda", dtype=torch.bfloat16)
    w = _randn(heads * 256, 512, gen=g, scale=0.05, device="cuda", dtype=torch.bfloat16)
    args = (q, cache, table, cu.cuda(), lens.cuda(), w)
    assert_rel(tri_mla_prefill.mla_prefill(*args), ref_mla._mla_prefill_reference(*args), 1e-2, "mla_prefill")


@triton.jit
def _activation_probe_kernel(x_ptr, sig_ptr, tanh_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(sig_ptr + offs, tri_pointwise.sigmoid_f32(x, FAST), mask=mask)
    tl.store(tanh_ptr + offs, tri_pointwise.tanh_f32(x, FAST), mask=mask)


@pytest.mark.cuda
def test_epilogue_sigmoid_tanh_fast_path_cuda() -> None:
    """The MoE GEMM epilogue's sigmoid and tanh on the NVIDIA fast path (MUFU ex2 / rcp) against float64, next to
    the portable path, over [-90, 90], N(0, 4), tiny values, +-inf and NaN. Tolerances, relative per value:
    sigmoid 1e-5 where it is above 1e-30 (both paths take 2^(-x log2 e) of the fp32-rounded product, whose error
    grows with |x|: ~3.5e-6 at x = -69, where the sigmoid reaches 1e-30), below that within 1e-30 absolute (the
    fast path flushes to 0 below x ~ -87.3); tanh 2e-6 (the polynomial below |z| = 0.25, ``2 sigmoid(2z) - 1``
    above); fast vs portable 1e-6 for the sigmoid (only the division differs: a few ulp) and 2e-6 for tanh (that
    difference times at most 2 sigmoid(2z) / tanh(z) ~ 5.1, at z = 0.25); +inf / -inf map to 1 / 0 and +-1
    (within 1e-6: the portable division is approximate), NaN to NaN."""
    g = seeded(23)
    x = torch.cat([torch.linspace(-90, 90, 200001), torch.randn(100000, generator=g) * 4,
                   torch.logspace(-12, -0.5, 2000), -torch.logspace(-12, -0.5, 2000)]).float().cuda()
    special = torch.tensor([float("inf"), float("-inf"), float("nan")], device="cuda")
    xs = torch.cat([x, special])
    exact_sig, exact_tanh = torch.sigmoid(x.double()), torch.tanh(x.double())
    outs = {}
    for fast in (False, True):
        sig, tanh = torch.full_like(xs, float("nan")), torch.full_like(xs, float("nan"))  # poisoned
        _activation_probe_kernel[(triton.cdiv(xs.numel(), 1024),)](xs, sig, tanh, xs.numel(), FAST=fast, BLOCK=1024)
        ends = torch.tensor([1.0, 0.0, 1.0, -1.0], device="cuda")
        assert torch.allclose(torch.cat([sig[-3:-1], tanh[-3:-1]]), ends, rtol=0, atol=1e-6), (fast, sig, tanh)
        assert sig[-1].isnan() and tanh[-1].isnan(), f"fast={fast}: NaN in, not NaN out"
        sig, tanh = sig[:-3], tanh[:-3]
        outs[fast] = sig, tanh
        live = exact_sig > 1e-30
        sig_err = ((sig.double() - exact_sig).abs() / exact_sig)[live].max().item()
        dead_err = (sig.double() - exact_sig).abs()[~live].max().item()
        tanh_err = ((tanh.double() - exact_tanh).abs() / exact_tanh.abs().clamp_min(1e-300)).max().item()
        assert sig_err < 1e-5, f"sigmoid fast={fast}: max relative error {sig_err:.2e}"
        assert dead_err < 1e-30, f"sigmoid fast={fast}: {dead_err:.2e} where it is below 1e-30"
        assert tanh_err < 2e-6, f"tanh fast={fast}: max relative error {tanh_err:.2e}"
    for i, (name, tol) in enumerate((("sigmoid", 1e-6), ("tanh", 2e-6))):
        a, b = outs[True][i].double(), outs[False][i].double()
        live = b.abs() > 1e-30
        diff = ((a - b).abs() / b.abs())[live].max().item()
        assert diff < tol, f"{name}: fast vs portable {diff:.2e}"


@pytest.mark.cuda
def test_norms_k3_cuda() -> None:
    g = seeded(14)
    x, r = (_randn(77, 7168, gen=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = _randn(7168, gen=g, device="cuda", dtype=torch.bfloat16)
    out = poisoned_like(x)
    out.copy_(tri_norm.rms_norm(x, w))
    assert_rel(out, ref_norm.rms_norm_reference(x, w), 1e-2, "rms_norm")
    a, b = tri_norm.add_rms_norm(x, r, w)
    ra, rb = ref_norm.add_rms_norm_reference(x, r, w)
    assert_rel(b, rb, 0.0, "new_residual")
    assert_rel(a, ra, 1e-2, "normed")
    xh, gh = (_randn(33, 96, 128, gen=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    wh = _randn(128, gen=g, device="cuda", dtype=torch.bfloat16)
    assert_rel(tri_norm.gated_rms_norm(xh, gh, wh), ref_gated_rms_norm(xh, gh, wh, backend="reference"), 1e-2,
               "gated_rms_norm")
    # KDA's output gate: the last H D columns of the in_proj output (row 3HD + D + H + HD wide), read in place
    wide = torch.full((33, 4 * 96 * 128 + 128 + 96), float("nan"), dtype=torch.bfloat16, device="cuda")
    wide[:, -96 * 128:] = gh.reshape(33, -1)
    strided = wide[:, -96 * 128:].reshape(33, 96, 128)
    assert torch.equal(tri_norm.gated_rms_norm(xh, strided, wh), tri_norm.gated_rms_norm(xh, gh, wh)), \
        "gated_rms_norm: the strided gate changed the result"
