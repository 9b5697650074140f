"""The cpu vendor's W8A8 kernels (csrc/int8_gemm.cpp, quant_w8.cpp, moe_w8.cpp): every int8 path
this machine can run gives the exact integer product (the float64 reference's int64 sums), and the
quantising ops are bit-identical to the torch vendor's (same float32 steps, same rounding).

The op parity suites (tests/ops/test_suites.py) check the ops against the float64
references on the default path; this file runs each path, including the ones the default skips.
"""

import pytest
import torch

import dlinfer.vendor
from dlinfer.conformance import reference as ref

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="cpu vendor cannot load here")

PORTABLE, INT16, VNNI = 0, 1, 2  # int16: vpmaddwd on AVX-512BW or AVX2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ops():
    dlinfer.vendor.load("cpu")
    return torch.ops.dlinfer_cpu


def _paths():
    return list(range(_ops().int8_best_path() + 1))


def _i8(*shape, g, low=-128, high=128):
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(torch.int8)


def test_vnni_is_used_where_the_cpu_has_it():
    from dlinfer.vendor.cpu import build

    flags = open("/proc/cpuinfo").read() if build.isa() == "AVX512" else ""
    expected = VNNI if "avx512_vnni" in flags else (INT16 if build.isa() in ("AVX512", "AVX2") else PORTABLE)
    assert _ops().int8_best_path() == expected


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 17])
@pytest.mark.parametrize("k", [1, 19, 31, 32, 33, 63, 64, 65, 127, 129, 576, 1000])
def test_int8_product_is_exact_on_every_path(m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    a, b = _i8(m, k, g=g), _i8(13, k, g=g)
    a[0] = -128  # -128 * -128 and -128 * 127 everywhere in the first row
    b[0], b[1] = -128, 127
    exact = ref.int8_product(a, b)
    for path in [-1, *_paths()]:  # -1: the ops' choice (beyond 8 rows oneDNN's int8 GEMM with VNNI)
        out = _ops().int8_matmul(a, b, path)
        assert out.dtype == torch.int32
        assert torch.equal(out.to(torch.int64), exact), f"path {path}"


def test_int8_product_partial_sums_past_2_to_the_31():
    """K = 65539: the +128 offset of the VNNI path takes lane sums past int32 (they wrap); the
    correction brings the result back exactly whenever the true product fits int32."""
    k, half = 65539, 32768
    g = torch.Generator().manual_seed(7)
    a = torch.full((3, k), 127, dtype=torch.int8)
    a[1] = -128
    a[2] = _i8(k, g=g, low=100)
    v = _i8(6, half, g=g, low=90)
    b = torch.cat([v, -v, _i8(6, k - 2 * half, g=g, low=-5, high=6)], dim=1)
    b[5] = 127  # 127 * 127 * 65539 = 1.06e9 < 2**31, but 255 * 127 * 65539 is not
    exact = ref.int8_product(a, b)
    for path in [-1, *_paths()]:
        assert torch.equal(_ops().int8_matmul(a, b, path).to(torch.int64), exact), f"path {path}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [3, 4, 5, 8])
@pytest.mark.parametrize("k,n", [(8192, 70), (8229, 37), (14336, 1)])
def test_int8_product_exact_where_k_is_walked_in_chunks(m, k, n, threads):
    """Rows of a past 32 KB from 3 rows on: the VNNI path walks K in chunks (few_rows_walk.h), the
    sums parked between them; a band of several 32-row blocks (one thread) or two bands; a K tail."""
    g = torch.Generator().manual_seed(m * 31 + k + n)
    a, b = _i8(m, k, g=g), _i8(n, k, g=g)
    a[0] = -128
    exact = ref.int8_product(a, b)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for path in _paths():
            assert torch.equal(_ops().int8_matmul(a, b, path).to(torch.int64), exact), f"path {path}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 37, 130])
def test_int8_product_exact_over_bands_of_any_row_count(n, m, threads):
    """The AVX2 build walks a thread's band of b as two halves side by side up to three rows of a
    (csrc/int8_gemm.cpp, tile_avx2): bands of one row, of an odd count (the middle row alone) and of
    an even one, on one thread or split in two; K with no tail, a tail of 32, and a scalar one."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (64, 96, 97, 2081):
            g = torch.Generator().manual_seed(n * 10007 + m * 101 + k)
            a, b = _i8(m, k, g=g), _i8(n, k, g=g)
            a[0, :3] = -128
            b[-1] = -128
            exact = ref.int8_product(a, b)
            for path in _paths():
                out = _ops().int8_matmul(a, b, path)
                assert torch.equal(out.to(torch.int64), exact), f"path {path}, k {k}"
    finally:
        torch.set_num_threads(before)


def test_many_rows_without_vnni_stay_off_torchs_plain_int_mm():
    """Beyond 8 rows the op takes torch._int_mm only where the CPU has VNNI: without it torch 2.13
    runs _int_mm as a plain loop, 16-19x this vendor's int16 kernel on the Zen 3 EPYC (csrc/
    int8_gemm.cpp, int8_matmul_rows). The op's choice (-1) must cost about what the int16 path does
    (the bound, 4x, is far from both the machine's noise and the plain loop's 16x)."""
    import time

    if _ops().int8_best_path() == VNNI:
        pytest.skip("this CPU has VNNI: beyond 8 rows the op takes oneDNN's int8 GEMM")
    g = torch.Generator().manual_seed(11)
    a, b = _i8(64, 2048, g=g), _i8(2048, 2048, g=g)

    def best_of(path):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            _ops().int8_matmul(a, b, path)
            times.append(time.perf_counter() - start)
        return min(times)

    best_of(-1), best_of(_ops().int8_best_path())  # first-call costs
    assert best_of(-1) < 4 * best_of(_ops().int8_best_path())


def test_unavailable_path_is_refused():
    with pytest.raises(RuntimeError, match="path"):
        _ops().int8_matmul(torch.zeros(1, 4, dtype=torch.int8), torch.zeros(2, 4, dtype=torch.int8), 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 40])
def test_linear_w8a8_bit_identical_to_the_torch_vendor(dtype, rows):
    from dlinfer.vendor.torch import quant as tq

    g = torch.Generator().manual_seed(rows)
    a, b = _i8(rows, 77, g=g), _i8(33, 77, g=g)
    rs, ls = torch.rand(rows, generator=g) / 100, torch.rand(33, generator=g) / 100
    for bias in (None, torch.randn(33, generator=g).to(dtype)):
        out = dlinfer.vendor.load("cpu").ops["linear_w8a8"](a, b, rs, ls, dtype, bias)
        assert torch.equal(out, tq.linear_w8a8(a, b, rs, ls, dtype, bias))


@pytest.mark.parametrize("rows", [1, 8, 9])
def test_linear_w8a8_strided_rows_and_paths_agree(rows):
    """a with strided rows (a slice of a wider tensor) gives a's dense result, on the default path
    (rows <= 8: the product in a plain buffer; more: int8_matmul_rows) and on every explicit one."""
    g = torch.Generator().manual_seed(100 + rows)
    wide, b = _i8(rows, 150, g=g), _i8(33, 70, g=g)
    a = wide[:, 3:73]
    rs, ls = torch.rand(rows, generator=g) / 100, torch.rand(33, 1, generator=g) / 100
    want = _ops().linear_w8a8(a.contiguous(), b, rs, ls, torch.float32, None, -1)
    assert torch.equal(_ops().linear_w8a8(a, b, rs, ls, torch.float32, None, -1), want)
    for path in range(_ops().int8_best_path() + 1):
        assert torch.equal(_ops().linear_w8a8(a, b, rs, ls, torch.float32, None, path), want)


def test_linear_w8a8_kernel_refuses_mismatched_k_by_name():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match=r"linear_w8a8: a \[M, K\] int8, b \[N, K\] int8"):
        _ops().linear_w8a8(_i8(1, 16, g=g), _i8(4, 15, g=g), torch.ones(1), torch.ones(4), torch.float32, None, -1)


def _rows(dtype, g, n=37, h=77):
    x = torch.randn(n, h, generator=g).to(dtype)
    x[0] = 0
    x[2, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 126.5])  # ties at scale 1
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_quant_bit_identical_and_exact(dtype):
    from dlinfer.vendor.torch import quant as tq

    x = _rows(dtype, torch.Generator().manual_seed(1))
    q, s = dlinfer.vendor.load("cpu").ops["dynamic_quant"](x)
    q_t, s_t = tq.dynamic_quant(x)
    assert torch.equal(q, q_t) and torch.equal(s, s_t)
    q_ref, s_ref = ref.dynamic_quant(x)
    assert torch.equal(q, q_ref) and torch.equal(s.double(), s_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norms_quantise_exactly_what_rms_norm_writes(dtype):
    """One pass per row, the same bytes as this vendor's rms_norm / add_rms_norm then dynamic_quant."""
    ops = dlinfer.vendor.load("cpu").ops
    g = torch.Generator().manual_seed(2)
    x, r, w = _rows(dtype, g), torch.randn(37, 77, generator=g).to(dtype), torch.randn(77, generator=g).to(dtype)
    q, s = ops["rms_norm_w8a8"](x, w, 1e-6)
    q_2, s_2 = ops["dynamic_quant"](ops["rms_norm"](x, w, 1e-6))
    assert torch.equal(q, q_2) and torch.equal(s, s_2)
    q, s, summed = ops["add_rms_norm_w8a8"](x, r, w, 1e-6)
    normed, summed_2 = ops["add_rms_norm"](x, r, w, 1e-6)
    q_2, s_2 = ops["dynamic_quant"](normed)
    assert torch.equal(q, q_2) and torch.equal(s, s_2) and torch.equal(summed, summed_2)


@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_fused_moe_w8a8_repeated_and_foreign_ids(tokens):
    """A token routed twice to one expert adds twice; ids outside [0, E) add nothing (value checks
    off: the op rejects them when on). Compared with the torch vendor on the ids it can take."""
    from dlinfer.vendor.torch import quant as tq

    g = torch.Generator().manual_seed(tokens)
    e, h, inter = 4, 40, 24
    x = torch.randn(tokens, h, generator=g)
    gu, dn = _i8(e, 2 * inter, h, g=g), _i8(e, h, inter, g=g)
    gs, ds = torch.rand(e, 2 * inter, generator=g) / 500, torch.rand(e, h, generator=g) / 300
    w = torch.rand(tokens, 3, generator=g)
    ids = torch.randint(0, e, (tokens, 3), generator=g)
    ids[:, 1] = ids[:, 0]
    kernel = dlinfer.vendor.load("cpu").ops["fused_moe_w8a8"]
    torch.testing.assert_close(kernel(x, gu, gs, dn, ds, w, ids, False), tq.fused_moe_w8a8(x, gu, gs, dn, ds, w, ids,
                                                                                           False), rtol=1e-5, atol=1e-5)
    foreign = ids.clone()
    foreign[:, 2] = e + 3
    kept = w.clone()
    kept[:, 2] = 0
    torch.testing.assert_close(kernel(x, gu, gs, dn, ds, w, foreign, False),
                               tq.fused_moe_w8a8(x, gu, gs, dn, ds, kept, ids, False), rtol=1e-5, atol=1e-5)
