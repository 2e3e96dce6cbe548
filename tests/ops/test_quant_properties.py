"""Property tests of the MX quantisers (hypothesis): error bounds, idempotence, sign symmetry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rocm_k3.ops import quant

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FP8_DTYPES = [pytest.param(torch.float8_e4m3fn, id="ocp"), pytest.param(torch.float8_e4m3fnuz, id="fnuz")]


@st.composite
def mx_tensors(draw: st.DrawFn) -> torch.Tensor:
    """fp32 [rows, 32 * blocks] with values spread over many binades, exact zeros of both signs included."""
    rows = draw(st.integers(1, 3))
    nblocks = draw(st.integers(1, 3))
    elements = st.one_of(
        st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False),
        st.sampled_from([0.0, -0.0, 7.0, -7.0, 3.5, 448.0, 240.0]),
    )
    values = draw(arrays(np.float32, (rows, 32 * nblocks), elements=elements))
    shift = draw(st.integers(-120, 100))  # move the whole tensor to another binade range (exact)
    return torch.from_numpy(values) * torch.tensor(2.0**shift, dtype=torch.float32)


def block_scale(scales: torch.Tensor) -> torch.Tensor:
    """fp64 [..., K]: each element's scale 2^(s - 127), from the scale bytes."""
    return torch.pow(2.0, scales.double() - 127.0).repeat_interleave(32, dim=-1)


@PROPERTY_SETTINGS
@given(x=mx_tensors(), rule=st.sampled_from(["ct", "ocp"]))
def test_mxfp4_round_trip_bound(x, rule):
    packed, scales = quant.quantize_mxfp4(x, rule)
    out = quant.dequantize_mxfp4(packed, scales, torch.float64)
    scale = block_scale(scales)
    v = x.double().abs() / scale
    half_step = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    bound = torch.maximum(half_step, v - 6.0) * scale  # above 6 the value saturates
    assert bool(((out - x.double()).abs() <= bound).all())
    assert v.max().item() < (7.0 if rule == "ct" else 8.0)  # saturation error <= 1 (ct) / 2 (ocp) scale units


@PROPERTY_SETTINGS
@given(x=mx_tensors(), rule=st.sampled_from(["ct", "ocp"]))
def test_mxfp4_idempotent(x, rule):
    packed, scales = quant.quantize_mxfp4(x, rule)
    again = quant.quantize_mxfp4(quant.dequantize_mxfp4(packed, scales), rule)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scales)


@PROPERTY_SETTINGS
@given(x=mx_tensors(), rule=st.sampled_from(["ct", "ocp"]))
def test_mxfp4_sign_symmetry(x, rule):
    packed, scales = quant.quantize_mxfp4(x, rule)
    neg_packed, neg_scales = quant.quantize_mxfp4(-x, rule)
    assert torch.equal(neg_scales, scales)
    assert torch.equal(neg_packed, packed ^ 0x88)  # only the two sign bits flip (zeros included: +0 <-> -0)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@PROPERTY_SETTINGS
@given(x=mx_tensors(), rule=st.sampled_from(["ct", "ocp"]))
def test_mxfp8_round_trip_bound(fp8_dtype, x, rule):
    q, scales = quant.quantize_mxfp8(x, fp8_dtype, rule)
    out = quant.dequantize_mxfp8(q, scales, torch.float64)
    scale = block_scale(scales)
    v = x.double().abs() / scale
    subnormal_half_step = 2.0**-10 if fp8_dtype == torch.float8_e4m3fn else 2.0**-11
    bound = torch.maximum(torch.clamp(v * 2.0**-4, min=subnormal_half_step), v - torch.finfo(fp8_dtype).max) * scale
    assert bool(((out - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@PROPERTY_SETTINGS
@given(x=mx_tensors())
def test_mxfp8_idempotent_ocp_rule(fp8_dtype, x):
    # Only the strict rule: under "ct" a value rounding up to 1.75 * 2^offset re-quantises with the next scale.
    q, scales = quant.quantize_mxfp8(x, fp8_dtype, "ocp")
    q2, scales2 = quant.quantize_mxfp8(quant.dequantize_mxfp8(q, scales), fp8_dtype, "ocp")
    assert torch.equal(scales2, scales)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@PROPERTY_SETTINGS
@given(x=mx_tensors(), rule=st.sampled_from(["ct", "ocp"]))
def test_mxfp8_sign_symmetry(fp8_dtype, x, rule):
    q, scales = quant.quantize_mxfp8(x, fp8_dtype, rule)
    neg_q, neg_scales = quant.quantize_mxfp8(-x, fp8_dtype, rule)
    assert torch.equal(neg_scales, scales)
    assert torch.equal(quant.dequantize_mxfp8(neg_q, neg_scales), -quant.dequantize_mxfp8(q, scales))
