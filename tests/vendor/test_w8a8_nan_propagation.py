"""A NaN in an activation row reaches that row's output through the W8A8 ops on every vendor: the
quantising ops give the row a NaN scale (not 0, which would turn the next linear_w8a8's row into
zeros and hide the NaN from DLINFER_OP_OVERFLOW and from the user), and the other rows are untouched.
K = 37 puts one NaN in a kernel's vector body and one in its scalar tail."""

from __future__ import annotations

import pytest
import torch

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.vendor import selection

VENDORS = [v for v in ("torch", "cpu", "triton") if v in dlinfer.vendor.available()]
K, N = 37, 24


def _rows(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, K, generator=g).to(dtype)
    x[1, 5] = float("nan")   # the vector body
    x[2, K - 1] = float("nan")  # the scalar tail
    return x


def _quantised(op, x):
    g = torch.Generator().manual_seed(4)
    w = torch.rand(K, generator=g).to(x.dtype) + 0.5
    if op == "dynamic_quant":
        return ops.dynamic_quant(x)
    if op == "rms_norm_w8a8":
        return ops.rms_norm_w8a8(x, w, 1e-6)
    residual = torch.randn(x.shape, generator=g).to(x.dtype)
    return ops.add_rms_norm_w8a8(x, residual, w, 1e-6)[:2]


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("op", ["dynamic_quant", "rms_norm_w8a8", "add_rms_norm_w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_row_keeps_its_nan_through_w8a8(vendor, op, dtype):
    x = _rows(dtype)
    g = torch.Generator().manual_seed(5)
    b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int64).to(torch.int8)
    linear_scale = torch.rand(N, generator=g) * 0.01 + 0.001
    with selection.using(vendor):
        xq, scale = _quantised(op, x)
        out = ops.linear_w8a8(xq, b, scale, linear_scale, torch.float32)
    assert torch.isfinite(scale[0]) and scale[0] > 0, (vendor, op, scale)
    assert torch.isnan(scale[1]) and torch.isnan(scale[2]), (vendor, op, scale)
    assert torch.isfinite(out[0]).all(), (vendor, op, out[0])
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all(), (vendor, op, out)
