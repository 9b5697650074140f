"""The two forms of dynamic_quant's quotient x / scale in the triton vendor (quant.py's docstring):
each must give the correctly rounded fp32 quotient, so that the codes equal the torch vendor's
bit for bit whichever form the launcher takes (the H200 found the division form issue-bound; a GPU
run times the other, benchmarks/gpu_tile_sweep.py).

Two levels: form 1's arithmetic in numpy against numpy's fp32 division (IEEE, correctly rounded),
on random pairs and on pairs whose quotients sit within 3 ulps of half-integers (where the codes
round), scales down to subnormal; and the kernels (dynamic_quant, add_rms_norm_w8a8) in both
forms against the torch vendor's codes and scales.
"""

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


def form1(x, d):
    return (x.astype(F64) * (1.0 / d.astype(F64))).astype(F32)


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


def test_the_float64_reciprocal_form_is_correctly_rounded():
    """Random and near-half-integer pairs, then every fp32 significand of x against a few scales
    (an odd one, one near 2, a subnormal one): the quotients pass near every midpoint there is."""
    form = form1
    every = np.arange(2**23, 2**24, dtype=np.int64).astype(F32) * F32(2.0**-23)  # [1, 2), all of them
    for x_exp, d in ((0, 3.0), (0, 1.1), (0, float.fromhex("0x1.fe2aaep+0")), (-134, float.fromhex("0x1.8p-140"))):
        x, d = every * F32(2.0**x_exp), F32(d)
        want = x / d
        assert np.isfinite(want).all() and np.array_equal(form(x, np.full_like(x, d)), want), d
    for seed in range(4):
        x, d = _pairs(50000, seed)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            want = x / d
            got = form(x, d)
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (x[~same][:5], d[~same][:5], got[~same][:5], want[~same][:5])
    inf = np.array([np.inf], dtype=F32)
    with np.errstate(invalid="ignore"):
        got = form(np.array([3.0, -2.0, np.inf], dtype=F32), np.repeat(inf, 3))
    assert got[0] == 0 and got[1] == 0 and np.isnan(got[2])


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


@pytest.mark.parametrize("form", [0, 1])
def test_dynamic_quant_codes_equal_the_torch_vendors_in_every_form(form, monkeypatch):
    monkeypatch.setattr(Q, "quotient_form", lambda: form)
    x = _adversarial_rows(form)
    q, s = load().ops["dynamic_quant"](x.to(DEVICE))
    want_q, want_s = TQ.dynamic_quant(x)
    finite = torch.isfinite(x).all(dim=1)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu()[finite], want_q[finite])
    # the inf row: x / inf = 0 for the finite values (the inf itself: NaN, no defined code)
    assert (q.cpu()[~finite][:, 1:] == 0).all()


@pytest.mark.parametrize("form", [0, 1])
def test_a_nan_row_gets_a_nan_scale_and_zero_codes(form, monkeypatch):
    monkeypatch.setattr(Q, "quotient_form", lambda: form)
    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    q, s = load().ops["dynamic_quant"](x.to(DEVICE))
    assert torch.isnan(s.cpu()[1]) and (q.cpu()[1] == 0).all()
    want_q, want_s = TQ.dynamic_quant(x[[0, 2]])
    assert torch.equal(q.cpu()[[0, 2]], want_q) and torch.equal(s.cpu()[[0, 2]], want_s)


def test_add_rms_norm_w8a8_is_the_same_in_both_forms(monkeypatch):
    """The fused norm quantises in the kernel: form 1 gives form 0's bytes and scales."""
    g = torch.Generator().manual_seed(7)
    h, r, w = torch.randn(9, 200, generator=g), torch.randn(9, 200, generator=g), torch.rand(200, generator=g) + 0.5
    args = (h.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-6)
    monkeypatch.setattr(Q, "quotient_form", lambda: 0)
    want = load().ops["add_rms_norm_w8a8"](*args)
    monkeypatch.setattr(Q, "quotient_form", lambda: 1)
    got = load().ops["add_rms_norm_w8a8"](*args)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
