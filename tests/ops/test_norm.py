"""rms_norm and add_rms_norm against the fp64 formula written out here."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel, seeded

from rocm_k3.ops import norm

# per-dtype tolerance on the normalised output: fp32 math rounded once to the output dtype
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOL]
SHAPES = [
    pytest.param((7, 128), id="T7-D128"),
    pytest.param((3, 5, 64), id="B3-T5-D64"),
    pytest.param((1, 32), id="T1-D32"),
]


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd / torch.sqrt((xd * xd).mean(dim=-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_formula(shape, dtype):
    gen = seeded(10)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    out = norm.rms_norm(x, weight, eps=1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_rel(out, rms_norm_f64(x, weight, 1e-5), TOL[dtype], "rms_norm")


def test_rms_norm_eps_matters_for_small_inputs():
    x = torch.full((2, 64), 1e-3)
    weight = torch.ones(64)
    # mean(x^2) = 1e-6: with eps 1e-5 the output is 1e-3 / sqrt(1.1e-5), not 1
    assert_rel(norm.rms_norm(x, weight, eps=1e-5), torch.full((2, 64), 1e-3 / (1.1e-5) ** 0.5), 1e-6, "eps")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_matches_two_steps(shape, dtype):
    gen = seeded(11)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = (torch.randn(shape, generator=gen) * 4).to(dtype)
    weight = torch.rand(shape[-1], generator=gen).to(torch.float32)
    x_copy, residual_copy = x.clone(), residual.clone()
    normed, new_residual = norm.add_rms_norm(x, residual, weight, eps=1e-6)
    assert torch.equal(x, x_copy) and torch.equal(residual, residual_copy), "inputs must not be modified"
    expected_residual = (x.double() + residual.double()).to(dtype)
    assert new_residual.dtype == dtype and torch.equal(new_residual, expected_residual)
    assert normed.dtype == dtype
    assert_rel(normed, rms_norm_f64(expected_residual, weight, 1e-6), TOL[dtype], "normed")


def test_norm_validation_errors():
    x = torch.randn(4, 64)
    w = torch.ones(64)
    with pytest.raises(ValueError, match=r"weight must have shape \[D\] = \(64,\)"):
        norm.rms_norm(x, torch.ones(32))
    with pytest.raises(TypeError, match="x must be bf16, fp16 or fp32"):
        norm.rms_norm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="eps"):
        norm.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        norm.add_rms_norm(x, torch.randn(4, 32), w)
    with pytest.raises(TypeError, match="residual dtype torch.bfloat16 must match x dtype torch.float32"):
        norm.add_rms_norm(x, x.bfloat16(), w)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        norm.rms_norm(x, [1.0] * 64)
    with pytest.raises(ValueError, match="unknown backend"):
        norm.rms_norm(x, w, backend="cuda-magic")
