"""The ``varlen_attention`` op (rocm_k3/ops/vision_attention.py) and its Triton kernel.

Tiers:
- unit: input validation; the reference against a per-image loop of plain softmax attention written here
  (fp32, 1e-6: the same math, different batching); dispatch through ``rocm_k3.ops``.
- ``interpret``: the Triton kernel under ``TRITON_INTERPRET=1`` on the CPU at small shapes (H = 2, D = 32 and the
  K2.5 head dim 72, images of 1..40 patches, 16 x 16 tiles so every sequence spans several blocks), fp32 and fp16
  inputs, poisoned outputs. fp32 1e-5, fp16 2e-3 (fp16 inputs and one fp16 rounding of the output; the
  interpreter runs the dots on fp32 operands).
- ``cuda``: K3 tower shapes (12 heads x 128, bf16, images of 4 to 4096 patches) against the reference, 1e-2
  (bf16 P @ V operands and one bf16 output rounding, 2^-9 each); the compile tier entry is ``varlen_attention``
  in tests/kernels/triton/test_triton_ops.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import (see tests/kernels/triton/test_triton_ops.py)

from rocm_k3 import ops  # noqa: E402
from rocm_k3.ops.vision_attention import varlen_attention_reference  # noqa: E402
from tests.helpers import assert_rel, poisoned_like, rel_err, seeded  # noqa: E402


def _packed(lens: list[int], heads: int, dim: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
            device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    total = sum(lens)
    q, k, v = ((torch.randn(total, heads, dim, generator=gen) * 1.5).to(device=device, dtype=dtype)
               for _ in range(3))
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    return q, k, v, cu


def _loop_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Independent formulation: each image, each head, each query row: softmax over that image's keys (fp64)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for n in lens:
        for h in range(q.shape[1]):
            keys, vals = k[start:start + n, h].double(), v[start:start + n, h].double()  # [n, D]
            for t in range(start, start + n):
                w = torch.softmax((keys @ q[t, h].double()) * scale, dim=0)  # [n]
                out[t, h] = w @ vals
        start += n
    return out


# ------------------------------------------------------------------------------------------------------- unit tier
@pytest.mark.parametrize("lens", [[1], [3, 0, 5], [7, 1, 12, 2]], ids=["one", "with-empty", "four"])
def test_reference_matches_loop(lens: list[int]) -> None:
    q, k, v, cu = _packed(lens, 3, 16, seeded(1))
    out = varlen_attention_reference(q, k, v, cu, scale=0.3)
    assert_rel(out, _loop_attention(q, k, v, lens, 0.3), 1e-6, "reference vs per-image loop")
    default = ops.varlen_attention(q, k, v, cu, backend="reference")
    assert_rel(default, _loop_attention(q, k, v, lens, 16 ** -0.5), 1e-6, "default scale D^-0.5")


def test_images_do_not_see_each_other() -> None:
    """Changing one image's keys/values leaves every other image's output bit-identical."""
    q, k, v, cu = _packed([5, 9, 4], 2, 8, seeded(2))
    base = ops.varlen_attention(q, k, v, cu, backend="reference")
    k2, v2 = k.clone(), v.clone()
    k2[5:14] += 3.0
    v2[5:14] -= 1.0
    moved = ops.varlen_attention(q, k2, v2, cu, backend="reference")
    assert torch.equal(moved[:5], base[:5]) and torch.equal(moved[14:], base[14:])
    assert not torch.equal(moved[5:14], base[5:14])


def test_validation_errors() -> None:
    q, k, v, cu = _packed([4, 4], 2, 8, seeded(3))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ops.varlen_attention(None, k, v, cu)
    with pytest.raises(ValueError, match=r"q must have shape \[T, H, D\]"):
        ops.varlen_attention(q[0], k[0], v[0], cu)
    with pytest.raises(ValueError, match="k must have the shape of q"):
        ops.varlen_attention(q, k[:, :1], v, cu)
    with pytest.raises(TypeError, match="v dtype"):
        ops.varlen_attention(q, k, v.half(), cu)
    with pytest.raises(TypeError, match="cu_seqlens must have dtype torch.int32"):
        ops.varlen_attention(q, k, v, cu.long())
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N \+ 1\]"):
        ops.varlen_attention(q, k, v, cu[:1])
    with pytest.raises(ValueError, match="scale must be finite"):
        ops.varlen_attention(q, k, v, cu, scale=-1.0)
    with pytest.raises(ValueError, match="max_seqlen"):
        ops.varlen_attention(q, k, v, cu, max_seqlen=-2)
    with pytest.raises(ValueError, match="end at T = 8"):
        ops.varlen_attention(q, k, v, torch.tensor([0, 4, 7], dtype=torch.int32), backend="reference")
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.varlen_attention(q, k, v, torch.tensor([0, 5, 3, 8], dtype=torch.int32), backend="reference")
    with pytest.raises(ValueError, match="longest sequence"):
        ops.varlen_attention(q, k, v, cu, max_seqlen=3, backend="reference")


def test_triton_declines_what_it_cannot_run() -> None:
    pytest.importorskip("triton")
    from rocm_k3.triton_kernels.vision_attention import varlen_attention_supports

    q, k, v, cu = _packed([4], 1, 8, seeded(4))
    ok, reason = varlen_attention_supports(q, k, v, cu)
    assert not ok and "GPU" in reason
    if torch.cuda.is_available():
        big = torch.zeros(4, 1, 320, device="cuda")
        ok, reason = varlen_attention_supports(big, big, big, cu.cuda())
        assert not ok and "head dim 320" in reason
        strided = torch.zeros(4, 1, 16, 2, device="cuda")[..., 0]
        ok, reason = varlen_attention_supports(strided, strided, strided, cu.cuda())
        assert not ok and "contiguous last dim" in reason


# -------------------------------------------------------------------------------------------------- interpret tier
def _interpreted() -> bool:
    try:
        import triton
        from rocm_k3.triton_kernels.runtime import interpreted
        from rocm_k3.triton_kernels.vision_attention import _varlen_attention_kernel
    except ImportError:
        return False
    return interpreted(_varlen_attention_kernel) and interpreted(triton.language.standard.zeros_like)


_INTERPRETED = _interpreted()
needs_interp = pytest.mark.skipif(
    not _INTERPRETED, reason="kernels are compiled in this process (GPU host, or triton imported before "
                             "TRITON_INTERPRET=1); the tier runs in test_vision_interpret_tier_in_subprocess")


@pytest.mark.interpret
@needs_interp
@pytest.mark.parametrize("dim", [32, 72], ids=["D32", "D72-K2.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_interpret(dim: int, dtype: torch.dtype) -> None:
    from rocm_k3.triton_kernels.vision_attention import varlen_attention_with

    lens = [1, 5, 17, 40, 16]
    q, k, v, cu = _packed(lens, 2, dim, seeded(5), dtype)
    ref = varlen_attention_reference(q, k, v, cu)
    out = varlen_attention_with(q, k, v, cu, block_m=16, block_n=16, out=poisoned_like(q))
    assert_rel(out, ref, 1e-5 if dtype == torch.float32 else 2e-3, f"triton {dtype} D{dim}")
    # strided q/k/v views of one packed qkv tensor (as the tower passes them), default tiles, given max_seqlen
    qkv = torch.stack([q, k, v], dim=1)  # [T, 3, H, D]
    out2 = varlen_attention_with(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, max_seqlen=40, scale=0.1,
                                 out=poisoned_like(q))
    assert_rel(out2, varlen_attention_reference(q, k, v, cu, scale=0.1), 1e-5 if dtype == torch.float32 else 2e-3,
               "strided views")


@pytest.mark.interpret
@pytest.mark.skipif(_INTERPRETED or torch.cuda.is_available(),
                    reason="the interpreter tier ran in this process (or a GPU is present)")
def test_vision_interpret_tier_in_subprocess() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-m", "interpret", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------------- cuda tier
@pytest.mark.cuda
def test_triton_k3_tower_shapes_cuda() -> None:
    """12 heads x 128 (K3), bf16, images of 2x2, 14x10, 32x48 and 64x64 patches packed together."""
    lens = [4, 140, 1536, 4096]
    q, k, v, cu = _packed(lens, 12, 128, seeded(6), torch.bfloat16, "cuda")
    ref = varlen_attention_reference(q, k, v, cu)
    out = ops.varlen_attention(q, k, v, cu, max_seqlen=max(lens), backend="triton")
    assert_rel(out, ref, 1e-2, "triton bf16 K3")
    from rocm_k3.triton_kernels.vision_attention import varlen_attention_with

    poisoned = varlen_attention_with(q, k, v, cu, out=poisoned_like(q))  # max_seqlen read from cu_seqlens
    assert_rel(poisoned, ref, 1e-2, "triton bf16 K3 (poisoned output, max_seqlen from the device)")
    qf, kf, vf = (x.float() for x in (q, k, v))
    assert rel_err(ops.varlen_attention(qf, kf, vf, cu, backend="triton"),
                   varlen_attention_reference(qf, kf, vf, cu)) <= 1e-5


@pytest.mark.cuda
def test_triton_k25_head_dim_cuda() -> None:
    """K2.5: 16 heads x 72 (padded to 128 in the kernel), bf16."""
    lens = [64, 900, 7]
    q, k, v, cu = _packed(lens, 16, 72, seeded(7), torch.bfloat16, "cuda")
    assert_rel(ops.varlen_attention(q, k, v, cu, backend="triton"), varlen_attention_reference(q, k, v, cu), 1e-2,
               "triton bf16 K2.5")
