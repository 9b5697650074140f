"""rms_norm / add_rms_norm parity against the fp64 reference."""

from dataclasses import dataclass

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import STRIDED, Check, parity_per_case, suite
from dlinfer.conformance.compare import assert_close, assert_equal, expect
from dlinfer.conformance.inputs import device, gen, randn, seed_of


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
    w = (1.0 + 0.2 * torch.randn(H, generator=g, dtype=torch.float64)).to(dtype=dtype, device=device())
    return g, x, w


def _rms_norm(vendor, case, dtype):
    _, x, w = _inputs(case, dtype, seed_of("rms", case.id, dtype))
    expected = ref.rms_norm(x, w, case.eps)
    out = ops.rms_norm(x, w, case.eps)
    expect(out.dtype == dtype and out.device.type == device().type, f"rms_norm: output {out.dtype} on {out.device}")
    assert_close(out, expected, "rms_norm")


def _add_rms_norm(vendor, case, dtype):
    g, x, w = _inputs(case, dtype, seed_of("add_rms", case.id, dtype))
    r = randn(case.shape, dtype, g, scale=2.0)
    expected_normed, _ = ref.add_rms_norm(x, r, w, case.eps)
    expected_sum = x + r  # one rounding in the activation dtype: exact comparison
    normed, summed = ops.add_rms_norm(x.clone(), r.clone(), w, case.eps)
    expect(normed.dtype == dtype and summed.dtype == dtype, f"add_rms_norm: outputs {normed.dtype}, {summed.dtype}")
    assert_equal(summed, expected_sum, "add_rms_norm", name="residual sum")
    assert_close(normed, expected_normed, "add_rms_norm", name="normed")


@suite("rms_norm")
def rms_norm(layouts):
    return parity_per_case("rms_norm", _rms_norm, CASES)


@suite("add_rms_norm")
def add_rms_norm(layouts):
    return parity_per_case("add_rms_norm", _add_rms_norm, CASES)


def _strided_rows(vendor):
    """A row-strided input (a slice of a wider buffer)."""
    g = gen(7)
    buf = randn((9, 160), torch.float32, g)
    x = buf[:, :128]
    w = randn((128,), torch.float32, g)
    out = ops.rms_norm(x, w, 1e-6)
    assert_close(out, ref.rms_norm(x, w, 1e-6), "rms_norm")


@suite("rms_norm_strided_rows")
def rms_norm_strided_rows(layouts):
    return [Check("rms_norm_strided_rows", "", "rms_norm", STRIDED, _strided_rows, case="strided_rows")]
