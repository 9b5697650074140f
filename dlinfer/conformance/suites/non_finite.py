"""Non-finite activations through the W8A8 family: NaN in, NaN out; inf in, non-finite out (the
one test of this rule: tests/ops/test_suites.py runs it on every vendor).

A quantising op (dynamic_quant, rms_norm_w8a8, add_rms_norm_w8a8) gives a row holding a NaN the
scale NaN; a row holding +-inf (and no NaN) a non-finite scale. Either way the next linear_w8a8
row is non-finite in every column, so DLINFER_OP_OVERFLOW and the user see it, where a scale of 0
(an amax that skipped the NaN) would have turned the row into plausible zeros. The other rows are
unchanged: finite, with the scales of the same rows quantised alone. The int8 codes of a
non-finite row are not specified (docs/ops.md). K = 37 puts one bad value in a kernel's vector
body and another in its scalar tail.
"""

from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance.checks import PARITY, Check, params, suite
from dlinfer.conformance.compare import assert_equal, expect
from dlinfer.conformance.inputs import device, gen, randn, seed_of

K, N = 37, 24
QUANTISING = ("dynamic_quant", "rms_norm_w8a8", "add_rms_norm_w8a8")
# row -> (column, value): rows 0 and 5 stay finite
BAD = {1: (5, float("nan")), 2: (K - 1, float("nan")), 3: (7, float("inf")), 4: (K - 2, float("-inf"))}


def _quantise(op, x, w, r):
    if op == "dynamic_quant":
        return ops.dynamic_quant(x)
    if op == "rms_norm_w8a8":
        return ops.rms_norm_w8a8(x, w, 1e-6)
    return ops.add_rms_norm_w8a8(x, r, w, 1e-6)[:2]


def _check(vendor, op, dtype):
    g = gen(seed_of("non_finite", op, dtype))
    clean = randn((6, K), dtype, g, scale=2.0)
    w = (1.0 + 0.2 * torch.randn(K, generator=g, dtype=torch.float64)).to(dtype=dtype, device=device())
    r = randn((6, K), dtype, g, scale=1.0)
    x = clean.clone()
    for row, (col, value) in BAD.items():
        x[row, col] = value
    b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int64).to(dtype=torch.int8, device=device())
    linear_scale = ((0.5 + torch.rand(N, generator=g, dtype=torch.float64)) / 74.0).to(torch.float32).to(device())
    xq, scale = _quantise(op, x, w, r)
    _, clean_scale = _quantise(op, clean, w, r)
    out = ops.linear_w8a8(xq, b, scale, linear_scale, torch.float32)
    for row in (1, 2):
        expect(bool(torch.isnan(scale[row])), f"{op}: a row holding a NaN has scale {float(scale[row])}, not NaN")
        expect(bool(torch.isnan(out[row]).all()), f"linear_w8a8 after {op}: row {row} (a NaN in its input) is not "
                                                  "NaN in every column")
    for row in BAD:
        expect(not bool(torch.isfinite(scale[row])), f"{op}: row {row} ({BAD[row][1]} in it) has a finite scale "
                                                     f"{float(scale[row])}")
        expect(not bool(torch.isfinite(out[row]).any()),
               f"linear_w8a8 after {op}: row {row} ({BAD[row][1]} in its input) has finite outputs")
    for row in (0, 5):
        expect(bool(torch.isfinite(scale[row])) and float(scale[row]) > 0, f"{op}: finite row {row} has scale "
                                                                          f"{float(scale[row])}")
        expect(bool(torch.isfinite(out[row]).all()), f"linear_w8a8 after {op}: finite row {row} is not finite")
    assert_equal(scale[[0, 5]], clean_scale[[0, 5]], op, name="the finite rows' scales")


@suite("w8a8_non_finite")
def w8a8_non_finite(layouts):
    return [Check("w8a8_non_finite", params(op, dt), op, PARITY, partial(_check, op=op, dtype=dt), case=op,
                  dtype=dt, uses=(op, "linear_w8a8"))
            for op in QUANTISING for dt in (torch.float32, torch.bfloat16, torch.float16)]
