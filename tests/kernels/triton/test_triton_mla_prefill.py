"""The expanded-heads MLA prefill kernel (rocm_k3/triton_kernels/mla_prefill_expanded.py) vs the reference.

Tiers as in test_triton_ops.py: ``interpret`` (fp32, TRITON_INTERPRET=1, small shapes, in a subprocess when triton
was imported compiled), ``cuda`` (K3 shapes in bf16 on the H200). Random inputs, outputs poisoned with NaN
before the call (an unwritten row never passes: rel_err of a NaN is inf).

Tolerances (relative L2 error): fp32 in the interpreter 1e-5 (IEEE fp32 dots, only summation order and the exp2
rewrite differ; measured ~1.5e-7), the gated output the same; bf16 on the GPU 1e-2 (the expanded k/v are rounded
to bf16 once, the probabilities once more before the PV dot: a few bf16 ulps of 2^-8).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import (see test_triton_ops.py)

triton = pytest.importorskip("triton")

from rocm_k3.ops import mla as ref_mla  # noqa: E402
from rocm_k3.triton_kernels import mla_prefill_expanded as tri_exp  # noqa: E402
from rocm_k3.triton_kernels.mla_prefill import mla_prefill_with  # noqa: E402
from rocm_k3.triton_kernels.runtime import interpreted  # noqa: E402
from tests.helpers import assert_rel, run_interpret_tier, seeded  # noqa: E402

_INTERPRETED = interpreted(tri_exp._expanded_kernel) and interpreted(triton.language.sigmoid)
needs_interp = pytest.mark.skipif(not _INTERPRETED, reason="kernels are compiled in this process; the interpreter "
                                                           "tier runs in test_interpret_tier_in_subprocess")
# (kv_lora_rank, rope, nope, v): the released latent and one that needs padded, masked tiles
GEOMETRIES = {"released": (512, 64, 128, 128), "R48-P24-N40-V24": (48, 24, 40, 24)}


def _problem(geo: str, lens: list[int], news: list[int], heads: int, gen: torch.Generator, *, bs: int = 16,
             device: str = "cpu", dtype: torch.dtype = torch.float32, w_scale: float | None = None) -> tuple:
    """Random paged cache (shuffled pages), queries = the last ``news[i]`` of ``lens[i]`` context tokens."""
    lora, rope, nope, vd = GEOMETRIES[geo]
    per = max(-(-n // bs) for n in lens)
    pages = per * len(lens) + 3
    cache = torch.randn(pages, bs, lora + rope, generator=gen)
    table = torch.randperm(pages, generator=gen)[:per * len(lens)].view(len(lens), per).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, nope + rope, generator=gen)
    w = torch.randn(heads * (nope + vd), lora, generator=gen) * (w_scale or lora ** -0.5)
    gate = torch.randn(int(cu[-1]), heads, vd, generator=gen) * 2
    put = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return (put(q), put(cache), table.to(device), cu.to(device), torch.tensor(lens, dtype=torch.int32,
            device=device), put(w)), put(gate)


def _poisoned(args: tuple) -> torch.Tensor:
    q, w = args[0], args[5]
    vd = w.shape[0] // q.shape[1] - (q.shape[2] - (args[1].shape[2] - w.shape[1]))
    return torch.full((q.shape[0], q.shape[1], vd), float("nan"), dtype=q.dtype, device=q.device)


# ------------------------------------------------------------------------------------------------- interpret tier
@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("geo", list(GEOMETRIES), ids=str)
@pytest.mark.parametrize("segment", [4096, 24], ids=["one_segment", "segments"])
def test_expanded_prefill_interpret(geo: str, segment: int) -> None:
    """Chunked prefill (3 of 20 new, a whole 5-token prompt, 33 of 70 new), one or several key segments (24 keys:
    the state is carried across segments, a segment boundary inside the diagonal), with and without the gate."""
    args, gate = _problem(geo, [20, 5, 70], [3, 5, 33], 3, seeded(11))
    want = ref_mla._mla_prefill_reference(*args)
    out = tri_exp.mla_prefill_expanded(*args, segment=segment, out=_poisoned(args))
    assert_rel(out, want, 1e-5, "expanded mla_prefill")
    out = tri_exp.mla_prefill_expanded(*args, segment=segment, gate=gate, out=_poisoned(args))
    assert_rel(out, want * torch.sigmoid(gate), 1e-5, "expanded mla_prefill, gated")


@pytest.mark.interpret
@needs_interp
def test_expanded_prefill_small_tiles_interpret() -> None:
    """Tiles smaller than the chunk (several query programs, several key blocks below the diagonal) and an
    explicit softmax scale."""
    args, _ = _problem("R48-P24-N40-V24", [90, 41], [70, 41], 2, seeded(12))
    want = ref_mla._mla_prefill_reference(*args, scale=0.05)
    out = tri_exp.mla_prefill_expanded(*args, scale=0.05, tiles=(16, 16, 4, 1), segment=40, out=_poisoned(args))
    assert_rel(out, want, 1e-5, "expanded mla_prefill, 16x16 tiles")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("threshold", [0, 6, 10_000], ids=["all_expanded", "mixed", "all_absorbed"])
def test_prefill_picks_per_sequence_interpret(threshold: int) -> None:
    """``mla_prefill`` splits one call between the two kernels by chunk length; every row is written either way,
    and the output gate is applied on both paths (the expanded kernel's epilogue, the absorbed path's fp32 W_uv
    product)."""
    args, gate = _problem("R48-P24-N40-V24", [20, 5, 40, 9], [3, 5, 18, 0], 3, seeded(13))
    want = ref_mla._mla_prefill_reference(*args)
    assert_rel(mla_prefill_with(*args, expanded_min_queries=threshold), want, 1e-5, f"threshold {threshold}")
    gated = mla_prefill_with(*args, expanded_min_queries=threshold, gate=gate)
    assert_rel(gated, ref_mla._mla_prefill_reference(*args, gate=gate), 1e-5, f"gated, threshold {threshold}")
    assert_rel(gated, want * torch.sigmoid(gate), 1e-5, f"gated vs sigmoid(gate) x ungated, threshold {threshold}")


def test_expanded_prefill_argument_errors() -> None:
    args, gate = _problem("R48-P24-N40-V24", [5], [5], 2, seeded(14))
    with pytest.raises(ValueError, match="gate must have shape"):
        tri_exp.mla_prefill_expanded(*args, gate=gate[:, :1])
    with pytest.raises(ValueError, match="segment must be >= 1"):
        tri_exp.mla_prefill_expanded(*args, segment=0)


@pytest.mark.interpret
@pytest.mark.skipif(_INTERPRETED or torch.cuda.is_available(),
                    reason="the interpreter tier ran in this process (or a GPU is present)")
def test_interpret_tier_in_subprocess() -> None:
    run_interpret_tier(__file__)


# ------------------------------------------------------------------------------------------------------ cuda tier
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(("lens", "news", "segment"), [([700, 130], [300, 130], 32768),
                                                       ([3000, 1500], [1000, 1500], 512)],
                         ids=["chunk_and_prompt", "segments"])
def test_expanded_prefill_k3_cuda(lens: list[int], news: list[int], segment: int) -> None:
    """K3 latents (512 + 64, 128 / 128 per head), TP-8's 12 heads, bf16, 64-token pages; also through
    ``mla_prefill`` with the default crossover and with every sequence on the absorbed kernel."""
    args, gate = _problem("released", lens, news, 12, seeded(15), bs=64, device="cuda", dtype=torch.bfloat16,
                          w_scale=0.05)
    want = ref_mla._mla_prefill_reference(*args)
    out = tri_exp.mla_prefill_expanded(*args, segment=segment, out=_poisoned(args))
    assert_rel(out, want, 1e-2, "expanded mla_prefill bf16")
    out = tri_exp.mla_prefill_expanded(*args, segment=segment, gate=gate, out=_poisoned(args))
    assert_rel(out, want.float() * torch.sigmoid(gate.float()), 1e-2, "expanded mla_prefill bf16, gated")
    assert_rel(mla_prefill_with(*args), want, 1e-2, "mla_prefill (default crossover)")
    assert_rel(mla_prefill_with(*args, expanded_min_queries=1 << 40), want, 1e-2, "mla_prefill, all absorbed")
