"""The few-row linears' walks over the weights (csrc/few_rows_walk.h), float32 and 16-bit: one
weight row at a time while x's rows fit in 32 KB, else two (adjacent rows; on AVX2 builds at up to
four rows of x at any K, two rows half the band apart: two chains of FMAs a row of x, each over a
long stream), and from three rows of x on K in chunks of 2 KB of each weight row with the sums
parked between chunks. The shapes here take every walk (chunked from M = 3 for float32 at K >= 4100,
from M = 3 or 4 for 16-bit; on AVX2 builds the far pair at up to four rows, unchunked, and one row
at a time at 5-8 rows of 16-bit x at K <= 1031, 5-7 at K = 2051): K with and without a tail (part
of a vector), short rows (K = 131, 576), N not a multiple of the row pair or of the 32-row block, a
band of an odd number of rows (the far pair's remainder row), a one-row weight, and a thread's band
of more than one block (one thread) or split in two (two threads). The far walks (the band's 2 or 4
parts side by side, each front to back) run on AVX2 builds at up to four rows of x, and on any build
where the weight streams a thread are set to 2 or 4 (Intel CPUs' default; `weight_streams` below
takes every setting on every machine).

- parity against a float64 product within the tolerance table's bound for `linear`;
- the outputs' bits do not depend on the weight streams a thread (1, 2 or 4; the few-row linears
  and the int8 GEMV), since each output's products are added in the same order in every walk;
- a row's bits are the same in any call: alone (M = 1: the one-row or the two-row walk) and among
  M rows (the chunked walk from M = 3), since every walk adds each output's products in the same
  order. This is what keeps a request's tokens the same whatever the batch it decodes in.
"""

import pytest
import torch

import dlinfer.vendor
from dlinfer.conformance.tolerances import tolerance

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="cpu vendor cannot load here")

# (K, N): K tails of 7, 4, 3, 5, 3 and 3 elements, none at 8192 and 576; N odd, even, past two blocks,
# one row, five (pairs (0, 2), (1, 3) and row 4 alone on AVX2)
SHAPES = [(1031, 67), (4100, 35), (8227, 66), (4133, 1), (8192, 70), (2051, 67), (131, 5), (576, 515)]


def _ops():
    dlinfer.vendor.load("cpu")
    return torch.ops.dlinfer_cpu


def _kernels():
    """(name, dtype, fn(x, w, b)) for every few-row kernel and path this machine runs."""
    ops = _ops()
    out = [("float32", torch.float32, ops.linear_few_rows)]
    for path in range(ops.linear_16bit_best_path() + 1):  # 0 portable, 1 vdpbf16ps where the CPU has it
        out.append((f"bfloat16 path {path}", torch.bfloat16,
                    lambda x, w, b, p=path: ops.linear_few_rows_16bit(x, w, b, p)))
    out.append(("float16", torch.float16, lambda x, w, b: ops.linear_few_rows_16bit(x, w, b, 0)))
    return out


def _inputs(m, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = (torch.randn(n, generator=g) * 0.5).to(dtype)
    return x, w, b


@pytest.fixture
def weight_streams():
    """Sets the kernels' weight streams a thread for the test (`set(n)`) and restores the setting in
    force before it (DLINFER_CPU_WEIGHT_STREAMS's, where a run sets it)."""
    from dlinfer.vendor.cpu import build

    ops = _ops()
    yield ops.set_weight_streams
    ops.set_weight_streams(build.weight_streams_from_env())


@pytest.fixture(params=[1, 2], ids=lambda t: f"{t}-threads")
def threads(request):
    """torch's intra-op threads for the test: one (a band of every row, several blocks) or two."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
def test_parity_with_a_float64_product(m, k, n, threads):
    for name, dtype, fn in _kernels():
        x, w, b = _inputs(m, k, n, dtype, seed=m * 131 + k)
        for bias in (None, b):
            out = fn(x, w, bias)
            expected = torch.einsum("mk,nk->mn", x.double(), w.double())
            if bias is not None:
                expected = expected + bias.double()
            atol, rtol = tolerance("linear", dtype)
            err, bound = (out.double() - expected).abs(), atol + rtol * expected.abs()
            assert out.dtype == dtype and bool((err <= bound).all()), \
                f"{name} M={m} K={k} N={n}: max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [2, 3, 4, 5, 6, 7, 8])
def test_a_rows_bits_are_the_same_alone_and_among_m_rows(m, k, n, threads):
    for name, dtype, fn in _kernels():
        x, w, b = _inputs(m, k, n, dtype, seed=m * 7 + k)
        whole = fn(x, w, b)
        alone = torch.cat([fn(x[i:i + 1], w, b) for i in range(m)])
        assert torch.equal(whole, alone), f"{name} M={m} K={k} N={n}"


def test_strided_rows_of_x_take_the_chunked_walk():
    """x's rows read through their stride (a view into a wider tensor), in the chunked walk."""
    for name, dtype, fn in _kernels():
        x, w, b = _inputs(4, 8227, 35, dtype, seed=3)
        wide = torch.zeros(4, 8300, dtype=dtype)
        wide[:, :8227] = x
        assert torch.equal(fn(wide[:, :8227], w, b), fn(x.contiguous(), w, b)), name


def _int8_kernels():
    """(name, fn(a, b)) for every int8 GEMM path this machine runs (0 portable, 1 int16, 2 VNNI)."""
    ops = _ops()
    return [(f"int8 path {p}", lambda a, b, p=p: ops.int8_matmul(a, b, p)) for p in range(ops.int8_best_path() + 1)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_outputs_do_not_depend_on_the_weight_streams(k, n, threads, weight_streams):
    """Every kernel's outputs under 2 and 4 weight streams a thread equal its outputs under one, at
    one to eight rows (the far walks at up to four, or two from five; past L1 at up to two rows
    the pairs far apart instead of adjacent), with N's remainder rows (not a multiple of the
    streams) walked one at a time."""
    for m in range(1, 9):
        cases = [(name, fn, _inputs(m, k, n, dtype, seed=m * 17 + k)) for name, dtype, fn in _kernels()]
        g = torch.Generator().manual_seed(m + k)
        a8 = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        weight_streams(1)
        one = [fn(x, w, b) for _, fn, (x, w, b) in cases] + [fn(a8, b8) for _, fn in _int8_kernels()]
        for streams in (2, 4):
            weight_streams(streams)
            outs = [fn(x, w, b) for _, fn, (x, w, b) in cases] + [fn(a8, b8) for _, fn in _int8_kernels()]
            names = [name for name, _, _ in cases] + [name for name, _ in _int8_kernels()]
            for name, ref, out in zip(names, one, outs):
                assert torch.equal(ref, out), f"{name} M={m} K={k} N={n}: {streams} streams differ from one"


def test_the_weight_streams_setting(weight_streams, monkeypatch):
    """The default is the CPU's (4 on Intel CPUs running the AVX-512 build, else 1);
    DLINFER_CPU_WEIGHT_STREAMS sets it when the kernels load (`build.apply_weight_streams`, any
    case), and a value other than auto, 1, 2 or 4 is refused by name, the setting left as it was."""
    from dlinfer.errors import VendorError
    from dlinfer.vendor.cpu import build

    ops = _ops()
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    assert ops.default_weight_streams() == (4 if intel and build.isa() == "AVX512" else 1)
    for value, expected in (("2", 2), ("4", 4), ("1", 1), (" AUTO ", ops.default_weight_streams()), ("2", 2)):
        monkeypatch.setenv("DLINFER_CPU_WEIGHT_STREAMS", value)
        assert build.apply_weight_streams() == expected == ops.weight_streams()
    for bad in ("3", "8", "fast", "0", "-1"):
        monkeypatch.setenv("DLINFER_CPU_WEIGHT_STREAMS", bad)
        with pytest.raises(VendorError, match="DLINFER_CPU_WEIGHT_STREAMS"):
            build.apply_weight_streams()
        assert ops.weight_streams() == 2  # the last good value's
    with pytest.raises(RuntimeError, match="set_weight_streams"):
        ops.set_weight_streams(3)


def test_a_bad_weight_streams_value_is_refused_before_any_build(monkeypatch):
    """`build()` reads DLINFER_CPU_WEIGHT_STREAMS before it looks for or compiles kernels, so a typo
    costs no build (minutes on 2 cores) before its error."""
    from dlinfer.errors import VendorError
    from dlinfer.vendor.cpu import build

    monkeypatch.setattr(build, "_loaded", None)  # as before the first cpu op; restored after the test
    monkeypatch.setattr(build, "prebuilt", lambda: pytest.fail("looked for prebuilt kernels first"))
    monkeypatch.setattr(build, "_build", lambda why: pytest.fail("compiled the kernels first"))
    monkeypatch.setenv("DLINFER_CPU_WEIGHT_STREAMS", "3")
    with pytest.raises(VendorError, match="DLINFER_CPU_WEIGHT_STREAMS='3'"):
        build.build()
