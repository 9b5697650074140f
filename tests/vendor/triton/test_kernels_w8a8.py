"""Kernel-level tests of the triton vendor's W8A8 kernels (quant.py, moe_w8a8.py); the op parity
suites (tests/ops/test_suites.py) compare them with the float64 references.

Here: the int8 tl.dot with int32 accumulation is exact at K tails and extreme values (the integer
product against int64 sums written here); the quantising kernels give the torch vendor's bytes and
scales exactly, and the fused norms quantise exactly what this vendor's rms_norm writes; the MoE
drops expert ids outside [0, E). Small shapes: everything runs under TRITON_INTERPRET=1.
"""

import pytest
import torch

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

from dlinfer.vendor.torch import quant as TQ  # noqa: E402
from dlinfer.vendor.triton import load  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ops():
    return load().ops


def _i8(*shape, g, low=-128, high=128):
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(torch.int8)


def _int64_product(a, b):
    A, B = a.cpu().long(), b.cpu().long()
    return torch.stack([(B * A[i]).sum(dim=-1) for i in range(A.shape[0])])


def test_w8a8_ops_are_triton_kernels():
    for op in ("dynamic_quant", "linear_w8a8", "rms_norm_w8a8", "add_rms_norm_w8a8", "fused_moe_w8a8"):
        assert _ops()[op].__module__.startswith("dlinfer.vendor.triton."), op


@pytest.mark.parametrize("m,k", [(1, 1), (3, 31), (17, 64), (5, 65), (16, 129), (2, 300)])
def test_int8_dot_is_exact(m, k):
    """Unit scales and float32 output: the output is the integer product (|sum| <= 2**24 here)."""
    g = torch.Generator().manual_seed(m * 1000 + k)
    a, b = _i8(m, k, g=g), _i8(70, k, g=g)  # N = 70: two column blocks, the second masked
    a[0], b[0], b[1] = -128, -128, 127
    ones_m, ones_n = torch.ones(m), torch.ones(70)
    out = _ops()["linear_w8a8"](a.to(DEVICE), b.to(DEVICE), ones_m.to(DEVICE), ones_n.to(DEVICE), torch.float32,
                                None)
    assert torch.equal(out.cpu().to(torch.int64), _int64_product(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_w8a8_matches_the_torch_vendor(dtype):
    g = torch.Generator().manual_seed(3)
    a, b = _i8(19, 77, g=g), _i8(33, 77, g=g)
    rs, ls = torch.rand(19, generator=g) / 100, torch.rand(33, generator=g) / 100
    bias = torch.randn(33, generator=g).to(dtype)
    out = _ops()["linear_w8a8"](*(t.to(DEVICE) for t in (a, b, rs, ls)), dtype, bias.to(DEVICE))
    torch.testing.assert_close(out.cpu(), TQ.linear_w8a8(a, b, rs, ls, dtype, bias), rtol=0, atol=0)


def _rows(dtype, g):
    x = torch.randn(9, 77, generator=g).to(dtype)
    x[0] = 0
    x[2, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 126.5])  # ties at scale 1
    return x.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantisation_bytes_and_scales_exact(dtype):
    ops = _ops()
    g = torch.Generator().manual_seed(4)
    x, r, w = _rows(dtype, g), torch.randn(9, 77, generator=g).to(dtype).to(DEVICE), _rows(dtype, g)[3]
    q, s = ops["dynamic_quant"](x)
    q_t, s_t = TQ.dynamic_quant(x)
    assert torch.equal(q, q_t) and torch.equal(s, s_t)
    q, s = ops["rms_norm_w8a8"](x, w, 1e-6)
    q_2, s_2 = ops["dynamic_quant"](ops["rms_norm"](x, w, 1e-6))
    assert torch.equal(q, q_2) and torch.equal(s, s_2)
    q, s, summed = ops["add_rms_norm_w8a8"](x, r, w, 1e-6)
    normed, summed_2 = ops["add_rms_norm"](x, r, w, 1e-6)
    q_2, s_2 = ops["dynamic_quant"](normed)
    assert torch.equal(q, q_2) and torch.equal(s, s_2) and torch.equal(summed, summed_2)


def test_fused_moe_w8a8_drops_foreign_ids():
    """Expert ids outside [0, E) add nothing (the op rejects them first with value checks on)."""
    g = torch.Generator().manual_seed(5)
    e, h, inter, t = 4, 40, 24, 5
    x = torch.randn(t, h, generator=g)
    gu, dn = _i8(e, 2 * inter, h, g=g), _i8(e, h, inter, g=g)
    gs, ds = torch.rand(e, 2 * inter, generator=g) / 500, torch.rand(e, h, generator=g) / 300
    w = torch.rand(t, 3, generator=g)
    ids = torch.randint(0, e, (t, 3), generator=g)
    foreign = ids.clone()
    foreign[:, 2] = torch.tensor([e, -1, e + 7, 2**20, -5])
    kept = w.clone()
    kept[:, 2] = 0
    dev = [v.to(DEVICE) for v in (x, gu, gs, dn, ds, w, foreign)]
    out = _ops()["fused_moe_w8a8"](*dev, False)
    torch.testing.assert_close(out.cpu(), TQ.fused_moe_w8a8(x, gu, gs, dn, ds, kept, ids, False), rtol=1e-5,
                               atol=1e-5)
