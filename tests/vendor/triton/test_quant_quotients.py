"""The three forms of dynamic_quant's quotient x / scale in the triton vendor (quant.py's docstring):
each must give the correctly rounded fp32 quotient, so that the codes equal the torch vendor's
bit for bit whichever form the launcher takes (the H200 found the division form issue-bound; a GPU
run times the other two, benchmarks/gpu_tile_sweep.py).

Two levels: the arithmetic of forms 1 and 2 in numpy against numpy's fp32 division (IEEE, correctly
rounded), on random and on adversarial pairs (quotients a few ulps from a point halfway between two
fp32 values, scales down to subnormal); and the kernels (dynamic_quant, rms_norm_w8a8) under each
form against the torch vendor's codes and scales. Triton's interpreter computes tl.fma as a
product and a sum, each rounded, so form 2 runs with an exact fp32 fma patched into it.
"""

from fractions import Fraction

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

from dlinfer.vendor.torch import quant as TQ  # noqa: E402
from dlinfer.vendor.triton import load  # noqa: E402
from dlinfer.vendor.triton import quant as Q  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F64 = np.float32, np.float64


def exact_fma32(a, b, c):
    """RN32(a * b + c) for fp32 arrays, exactly: a * b is exact in fp64; the fp64 sum s and its
    error e (TwoSum) hold the exact value s + e. Rounding s to fp32 is right unless s sits exactly
    halfway between two fp32 values (no fp32 midpoint can lie strictly between s and s + e: it
    would be a closer fp64 number), where e's sign decides."""
    a, b, c = (np.asarray(v, dtype=F32).astype(F64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    with np.errstate(over="ignore", invalid="ignore"):
        f = s.astype(F32)
        other = np.nextafter(f, np.where(s > f.astype(F64), F32(np.inf), F32(-np.inf))).astype(F64)
        midpoint = (s == (f.astype(F64) + other) / 2) & (e != 0)
        nudged = np.nextafter(s, s + e).astype(F32)
    return np.where(midpoint, nudged, f)


def form1(x, d):
    return (x.astype(F64) * (1.0 / d.astype(F64))).astype(F32)


def form2(x, d):
    k = np.where(d < F32(2.0**-60), F32(2.0**100), F32(1.0))
    xs, ds = x * k, d * k
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = F32(1.0) / ds
        q = xs * y
        r = exact_fma32(-q, ds, xs)
        return np.where(d == np.inf, q, exact_fma32(r, y, q))


def _pairs(n, seed):
    """(x, d) fp32: random magnitudes, and x a few ulps from (j + 1/2) d and from j d."""
    rng = np.random.default_rng(seed)
    d = np.exp2(rng.uniform(-149, 120, n)).astype(F32) * rng.uniform(1, 2, n).astype(F32)
    d = np.where(d == 0, F32(2.0**-149), d).astype(F32)
    j = rng.integers(-128, 128, n).astype(F64) + rng.choice([0.0, 0.5], n)
    x = (j * d.astype(F64)).astype(F32)
    ulps = rng.integers(-3, 4, n)
    for _ in range(3):  # walk x up to 3 ulps away
        x = np.where(ulps > 0, np.nextafter(x, F32(np.inf)), np.where(ulps < 0, np.nextafter(x, F32(-np.inf)), x))
        ulps = ulps - np.sign(ulps)
    wild = rng.random(n) < 0.3  # some x of any size up to 127.5 d
    x = np.where(wild, (rng.uniform(-127.5, 127.5, n) * d.astype(F64)).astype(F32), x).astype(F32)
    return x, d


def _rn32(v: Fraction) -> F32:
    """An exact rational rounded to the nearest fp32, ties to even (a reference for the test)."""
    f = F32(float(v))
    candidates = [f, np.nextafter(f, F32(np.inf)), np.nextafter(f, F32(-np.inf))]
    key = [(abs(Fraction(float(c)) - v), int(np.array(c).view(np.uint32)) & 1) for c in candidates]
    return candidates[min(range(3), key=key.__getitem__)]


def test_exact_fma32_rounds_once():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(300).astype(F32)
    b = (rng.standard_normal(300) * np.exp2(rng.integers(-30, 30, 300))).astype(F32)
    c = (-(a.astype(F64) * b) * (1 + rng.standard_normal(300) * 2.0**-20)).astype(F32)  # cancellation
    got = exact_fma32(a, b, c)
    for ai, bi, ci, gi in zip(a, b, c, got):
        assert gi == _rn32(Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci)))
    # fp64 rounds 1 + 2**-24 + 2**-60 to the fp32 midpoint 1 + 2**-24; the exact value is above it
    one_up = np.nextafter(F32(1.0), F32(2.0))
    assert exact_fma32(F32(2.0**-30), F32(2.0**-30), F32(1.0)) == F32(1.0)
    assert exact_fma32(F32(1 + 2.0**-23), F32(2.0**-24), F32(1.0)) == one_up  # 1 + 2**-24 + 2**-47
    assert exact_fma32(F32(1.0), F32(2.0**-24), F32(1.0)) == F32(1.0)  # a true tie: to even
    assert exact_fma32(F32(1.0), F32(2.0**-24), one_up) == np.nextafter(one_up, F32(2.0))  # a tie, to even


@pytest.mark.parametrize("form", [form1, form2], ids=["recip64", "fma32"])
def test_quotient_forms_are_correctly_rounded(form):
    for seed in range(4):
        x, d = _pairs(50000, seed)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            want = x / d
            got = form(x, d)
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        if form is form2:  # exact from 2**-20 on; below, a code of 0 whatever the last ulp
            tiny = np.abs(want) < 2.0**-20
            assert (np.abs(got[tiny]) < 2.0**-19).all()
            same |= tiny
        assert same.all(), (x[~same][:5], d[~same][:5], got[~same][:5], want[~same][:5])
    inf = np.array([np.inf], dtype=F32)
    with np.errstate(invalid="ignore"):
        got = form(np.array([3.0, -2.0, np.inf], dtype=F32), np.repeat(inf, 3))
    assert got[0] == 0 and got[1] == 0 and np.isnan(got[2])


@pytest.fixture
def exact_fma(monkeypatch):
    """The interpreter's fma made exact (as a GPU's fma.rn.f32)."""
    from triton.runtime import interpreter

    def create_fma(self, x, y, z):
        assert x.data.dtype == np.float32, x.data.dtype
        return interpreter.TensorHandle(exact_fma32(x.data, y.data, z.data), z.dtype.scalar)

    if not torch.cuda.is_available():
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)


def _adversarial_rows(seed):
    """[R, 96] float32 rows whose quotients sit near half-integers, at scales from subnormal up,
    plus a zero row, one with an inf and one spanning the float range."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for e in (-140, -130, -100, -61, -60, -20, 0, 20, 100, 120):
        amax = torch.tensor(2.0**e, dtype=torch.float64) * (1 + torch.rand((), generator=g, dtype=torch.float64))
        amax = amax.float()
        scale = (amax / torch.tensor(127.0)).double()
        j = torch.randint(-127, 127, (95,), generator=g).double() + 0.5
        x = (j * scale).float()
        x = torch.where(torch.rand(95, generator=g) < 0.5, torch.nextafter(x, torch.full_like(x, float("inf"))), x)
        rows.append(torch.cat([amax.view(1), x]))
    rows.append(torch.zeros(96))
    rows.append(torch.cat([torch.tensor([float("inf"), -1.0]), torch.randn(94, generator=g)]))
    rows.append(torch.logspace(-40, 38, 96, dtype=torch.float64).float() * (-1) ** torch.arange(96))
    return torch.stack(rows)


@pytest.mark.parametrize("form", [0, 1, 2])
def test_dynamic_quant_codes_equal_the_torch_vendors_in_every_form(form, monkeypatch, exact_fma):
    monkeypatch.setattr(Q, "quotient_form", lambda: form)
    x = _adversarial_rows(form)
    q, s = load().ops["dynamic_quant"](x.to(DEVICE))
    want_q, want_s = TQ.dynamic_quant(x)
    finite = torch.isfinite(x).all(dim=1)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu()[finite], want_q[finite])
    # the inf row: x / inf = 0 for the finite values (the inf itself: NaN, no defined code)
    assert (q.cpu()[~finite][:, 1:] == 0).all()


@pytest.mark.parametrize("form", [1, 2])
def test_a_nan_row_gets_a_nan_scale_and_zero_codes(form, monkeypatch, exact_fma):
    monkeypatch.setattr(Q, "quotient_form", lambda: form)
    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    q, s = load().ops["dynamic_quant"](x.to(DEVICE))
    assert torch.isnan(s.cpu()[1]) and (q.cpu()[1] == 0).all()
    want_q, want_s = TQ.dynamic_quant(x[[0, 2]])
    assert torch.equal(q.cpu()[[0, 2]], want_q) and torch.equal(s.cpu()[[0, 2]], want_s)


@pytest.mark.parametrize("form", [1, 2])
def test_rms_norm_w8a8_is_the_same_in_every_form(form, monkeypatch, exact_fma):
    """The fused norm quantises in the kernel: forms 1 and 2 give form 0's bytes and scales."""
    g = torch.Generator().manual_seed(7)
    h, r, w = torch.randn(9, 200, generator=g), torch.randn(9, 200, generator=g), torch.rand(200, generator=g) + 0.5
    args = (h.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-6)
    want = load().ops["add_rms_norm_w8a8"](*args)
    monkeypatch.setattr(Q, "quotient_form", lambda: form)
    got = load().ops["add_rms_norm_w8a8"](*args)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
