"""rms_norm / add_rms_norm parity against the fp64 reference."""

from dataclasses import dataclass

import pytest
import torch

import dlinfer.ops as ops

from . import reference as ref
from .cases import DEVICE, DTYPE_PARAMS, active, gen, randn, seed_of, skip_unless_supported, vendor_params
from .compare import assert_close, assert_equal


@dataclass(frozen=True)
class NormCase:
    id: str
    shape: tuple  # [..., H]
    eps: float
    small: bool


CASES = [
    NormCase("t1_h64", (1, 64), 1e-6, True),
    NormCase("t7_h80", (7, 80), 1e-5, True),
    NormCase("t0_h128", (0, 128), 1e-6, True),
    NormCase("b1_t5_h96", (1, 5, 96), 1e-6, True),
    NormCase("t37_h4096", (37, 4096), 1e-6, False),
    NormCase("t129_h1000", (129, 1000), 1e-5, False),
    NormCase("b2_t3_h5120", (2, 3, 5120), 1e-6, False),
]


def _inputs(case, dtype, seed):
    g = gen(seed)
    H = case.shape[-1]
    x = randn(case.shape, dtype, g, scale=3.0)
    w = (1.0 + 0.2 * torch.randn(H, generator=g, dtype=torch.float64)).to(dtype=dtype, device=DEVICE)
    return g, x, w


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("vendor,case", vendor_params(CASES))
def test_rms_norm(vendor, case, dtype):
    skip_unless_supported(vendor, dtype)
    _, x, w = _inputs(case, dtype, seed_of("rms", case.id, dtype))
    expected = ref.rms_norm(x, w, case.eps)
    with active(vendor):
        out = ops.rms_norm(x, w, case.eps)
    assert out.dtype == dtype and out.device.type == DEVICE.type
    assert_close(out, expected, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("vendor,case", vendor_params(CASES))
def test_add_rms_norm(vendor, case, dtype):
    skip_unless_supported(vendor, dtype)
    g, x, w = _inputs(case, dtype, seed_of("add_rms", case.id, dtype))
    r = randn(case.shape, dtype, g, scale=2.0)
    expected_normed, _ = ref.add_rms_norm(x, r, w, case.eps)
    expected_sum = x + r  # one rounding in the activation dtype: exact comparison
    with active(vendor):
        normed, summed = ops.add_rms_norm(x.clone(), r.clone(), w, case.eps)
    assert normed.dtype == dtype and summed.dtype == dtype
    assert_equal(summed, expected_sum, "add_rms_norm", name="residual sum")
    assert_close(normed, expected_normed, "add_rms_norm", name="normed")


@pytest.mark.parametrize("vendor", vendor_params())
def test_rms_norm_strided_rows(vendor):
    """A row-strided input (a slice of a wider buffer)."""
    g = gen(7)
    buf = randn((9, 160), torch.float32, g)
    x = buf[:, :128]
    w = randn((128,), torch.float32, g)
    with active(vendor):
        out = ops.rms_norm(x, w, 1e-6)
    assert_close(out, ref.rms_norm(x, w, 1e-6), "rms_norm")
