"""W8A8 parity (dynamic_quant, linear_w8a8, rms_norm_w8a8, add_rms_norm_w8a8) against the
fp64 references.

Exact: dynamic_quant's int8 values (the contract fixes float32 division and round half to even),
the int8 products (read through linear_w8a8 with unit scales where they fit float32), the residual
sum. Within the tolerance table: scales and float outputs. The fused norms quantise a norm whose
last bit may legitimately differ from the reference's, so their int8 values may differ by one step.

Adversarial inputs: K not a multiple of 8/16 (and K = 1), zero rows (scale 0, values 0, no NaN),
a row with one huge value, exact rounding ties, 1-3 leading dims, empty batches.
"""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import PARITY, Check, params, parity_per_case, suite
from dlinfer.conformance.compare import assert_close, assert_equal, expect
from dlinfer.conformance.inputs import device, gen, randn, seed_of

I8 = torch.int8


@dataclass(frozen=True)
class QuantCase:
    id: str
    shape: tuple  # [..., K]
    small: bool = True


CASES = [
    QuantCase("t1_k64", (1, 64)),
    QuantCase("t7_k77", (7, 77)),
    QuantCase("t5_k1", (5, 1)),
    QuantCase("t0_k128", (0, 128)),
    QuantCase("b1_t5_k96", (1, 5, 96)),
    QuantCase("b2_h3_t4_k19", (2, 3, 4, 19)),
    QuantCase("t37_k4096", (37, 4096), False),
    QuantCase("t129_k1000", (129, 1000), False),
]


def _adversarial(x):
    """Row 0 all zeros, row 1 one huge value (the others quantise to ~0), row 2 exact ties."""
    rows = x.view(-1, x.shape[-1])
    k = rows.shape[-1]
    if rows.shape[0] > 3:
        rows[0] = 0
        rows[1, k // 2] = 3.0e4
        if k >= 8:  # amax 127 -> scale 1: x / scale lands on .5 exactly
            ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 126.5], dtype=x.dtype, device=x.device)
            rows[2, :8] = ties
            rows[2, 8:] = 0.25
    return x


def _dynamic_quant(vendor, case, dtype):
    g = gen(seed_of("dq", case.id, dtype))
    x = _adversarial(randn(case.shape, dtype, g, scale=3.0))
    q_ref, s_ref = ref.dynamic_quant(x)
    xq, scale = ops.dynamic_quant(x.clone(), torch.int8, "PER_TOKEN")
    expect(xq.dtype == I8 and scale.dtype == torch.float32, f"dynamic_quant: outputs {xq.dtype}, {scale.dtype}")
    expect(tuple(scale.shape) == tuple(case.shape[:-1]), f"dynamic_quant: scale shape {tuple(scale.shape)}")
    expect(not bool(scale.isnan().any()), "dynamic_quant: NaN scale")
    assert_equal(xq, q_ref, "dynamic_quant", name="xq")
    assert_close(scale, s_ref, "dynamic_quant", name="scale")


def _int8(shape, g, low=-128, high=128):
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype=I8, device=device())


@dataclass(frozen=True)
class LinearCase:
    id: str
    lead: tuple
    k: int
    n: int
    bias: bool
    scale_col: bool  # rms_scale [..., 1] (else [...]), linear_scale [N, 1] (else [N])
    small: bool = True


LINEAR_CASES = [
    LinearCase("t1_k64_n48", (1,), 64, 48, True, True),
    LinearCase("t7_k77_n33", (7,), 77, 33, False, False),
    LinearCase("t0_k64_n16", (0,), 64, 16, True, False),
    LinearCase("b2_t3_k100_n24", (2, 3), 100, 24, True, False),
    LinearCase("b1_h2_t3_k19_n5", (1, 2, 3), 19, 5, False, True),
    LinearCase("t37_k4096_n512", (37,), 4096, 512, True, True, False),
    # prefill-sized M (kernels switch tiles past 64 rows), partial in M, N and K
    LinearCase("t130_k200_n136", (130,), 200, 136, True, False),
]


def _linear_w8a8(vendor, case, dtype):
    g = gen(seed_of("w8a8", case.id, dtype))
    a = _int8((*case.lead, case.k), g)
    b = _int8((case.n, case.k), g)
    rows = 1
    for d in case.lead:
        rows *= d
    rms = (0.5 + torch.rand(rows, generator=g, dtype=torch.float64)) / (74.0 * case.k**0.5)
    lin = (0.5 + torch.rand(case.n, generator=g, dtype=torch.float64)) / 74.0
    rms = rms.to(torch.float32).to(device()).reshape(*case.lead, *((1,) if case.scale_col else ()))
    lin = lin.to(torch.float32).to(device()).reshape(case.n, *((1,) if case.scale_col else ()))
    bias = randn((case.n,), dtype, g) if case.bias else None
    expected = ref.linear_w8a8(a, b, rms, lin, bias)
    out = ops.linear_w8a8(a, b, rms, lin, dtype, torch.int8, bias)
    expect(out.dtype == dtype and tuple(out.shape) == (*case.lead, case.n),
           f"linear_w8a8: output {tuple(out.shape)} {out.dtype}")
    assert_close(out, expected, "linear_w8a8")


def _int_product(vendor, k, fill):
    """Unit scales, float32 out: the output is the int8 product itself (|sum| <= 2**24 here, so
    float32 holds it exactly); extreme values make an inexact accumulation visible."""
    g = gen(seed_of("w8a8_int", k, fill))
    if fill == "extreme":  # -128 * -128 everywhere, and mixed +-127 / -128 rows
        a = torch.full((4, k), -128, dtype=I8, device=device())
        a[1] = 127
        a[2, ::2] = 127
        a[3] = _int8((k,), g)
        b = torch.full((6, k), -128, dtype=I8, device=device())
        b[1, 1::2] = 127
        b[2:] = _int8((4, k), g)
    else:
        a, b = _int8((9, k), g), _int8((5, k), g)
    one_r = torch.ones(a.shape[0], dtype=torch.float32, device=device())
    one_l = torch.ones(b.shape[0], dtype=torch.float32, device=device())
    out = ops.linear_w8a8(a, b, one_r, one_l, torch.float32)
    exact = ref.int8_product(a, b)
    expect(int(exact.abs().max()) <= 2**24, "int product check: sums past float32's exact integers")
    assert_equal(out, exact.to(torch.float32), "linear_w8a8", name="int8 product")


def _cancelling_sum(vendor):
    """Partial sums far past 2**24 (K = 65539, |a * b| ~ 2**14: even 16 SIMD lanes each sum past
    2**24) that cancel to small exact results: a float32 accumulation loses units on the way and
    ends off by whole integers. Within int32: K * 2**14 < 2**31."""
    k, half = 65539, 32768
    g = gen(seed_of("w8a8_cancel"))
    a = torch.full((3, k), 127, dtype=I8, device=device())
    a[1, ::3] = -128
    a[2] = _int8((k,), g, 100, 128)
    v = _int8((6, half), g, 90, 128)
    b = torch.cat([v, -v, _int8((6, k - 2 * half), g, -5, 6)], dim=1)
    one_r = torch.ones(3, dtype=torch.float32, device=device())
    one_l = torch.ones(6, dtype=torch.float32, device=device())
    out = ops.linear_w8a8(a, b, one_r, one_l, torch.float32)
    exact = ref.int8_product(a, b)
    expect(int(exact.abs().max()) <= 2**24, "cancelling sum check: results past float32's exact integers")
    assert_equal(out, exact.to(torch.float32), "linear_w8a8", name="cancelling int8 product")


def _check_fused_quant(op, xq, scale, q_ref, s_ref, dtype):
    expect(xq.dtype == I8 and scale.dtype == torch.float32, f"{op}: outputs {xq.dtype}, {scale.dtype}")
    expect(not bool(scale.isnan().any()), f"{op}: NaN scale")
    # amax = 127 * scale: the norm's largest magnitude per row, within the norm's tolerance
    assert_close(scale * 127.0, s_ref * 127.0, op, dtype=dtype, name="127 * scale")
    if xq.numel():
        diff = int((xq.cpu().to(torch.int16) - q_ref.to(torch.int16)).abs().max())
        expect(diff <= 1, f"{op}: xq differs from the reference by {diff} steps (at most 1 allowed)")


def _norm_inputs(case, dtype, tag):
    g = gen(seed_of(tag, case.id, dtype))
    H = case.shape[-1]
    x = _adversarial(randn(case.shape, dtype, g, scale=3.0))
    w = (1.0 + 0.2 * torch.randn(H, generator=g, dtype=torch.float64)).to(dtype=dtype, device=device())
    return g, x, w


def _rms_norm_w8a8(vendor, case, dtype):
    _, x, w = _norm_inputs(case, dtype, "rms_w8a8")
    q_ref, s_ref, _ = ref.rms_norm_w8a8(x, w, 1e-6)
    xq, scale = ops.rms_norm_w8a8(x.clone(), w, 1e-6, torch.int8)
    expect(tuple(scale.shape) == tuple(case.shape[:-1]), f"rms_norm_w8a8: scale shape {tuple(scale.shape)}")
    _check_fused_quant("rms_norm_w8a8", xq, scale, q_ref, s_ref, dtype)


def _add_rms_norm_w8a8(vendor, case, dtype):
    g, x, w = _norm_inputs(case, dtype, "add_rms_w8a8")
    r = randn(case.shape, dtype, g, scale=2.0)
    q_ref, s_ref, _, _ = ref.add_rms_norm_w8a8(x, r, w, 1e-6)
    xq, scale, summed = ops.add_rms_norm_w8a8(x.clone(), r.clone(), w, 1e-6, torch.int8)
    expect(summed.dtype == dtype, f"add_rms_norm_w8a8: sum {summed.dtype}")
    assert_equal(summed, x + r, "add_rms_norm_w8a8", name="residual sum")
    _check_fused_quant("add_rms_norm_w8a8", xq, scale, q_ref, s_ref, dtype)


@suite("dynamic_quant")
def dynamic_quant(layouts):
    return parity_per_case("dynamic_quant", _dynamic_quant, CASES)


@suite("linear_w8a8")
def linear_w8a8(layouts):
    return parity_per_case("linear_w8a8", _linear_w8a8, LINEAR_CASES)


@suite("linear_w8a8_int_product")
def linear_w8a8_int_product(layouts):
    checks = [Check("linear_w8a8_int_product", params(f"k{k}", fill), "linear_w8a8", PARITY,
                    partial(_int_product, k=k, fill=fill), case=f"k{k}_{fill}")
              for k, fill in ((19, "random"), (1000, "random"), (1000, "extreme"), (1024, "extreme"))]
    checks.append(Check("linear_w8a8_int_product", "k65539_cancelling", "linear_w8a8", PARITY, _cancelling_sum,
                        case="k65539_cancelling"))
    return checks


@suite("rms_norm_w8a8")
def rms_norm_w8a8(layouts):
    return parity_per_case("rms_norm_w8a8", _rms_norm_w8a8, CASES)


@suite("add_rms_norm_w8a8")
def add_rms_norm_w8a8(layouts):
    return parity_per_case("add_rms_norm_w8a8", _add_rms_norm_w8a8, CASES)
