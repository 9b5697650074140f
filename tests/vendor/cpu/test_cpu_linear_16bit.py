"""The cpu vendor's few-row bfloat16 / float16 linear (csrc/linear_16bit.cpp), on every path this
machine can run: the AVX512_BF16 one (vdpbf16ps) where the CPU has it, and the portable one,
which the tests force through the op's `path` argument.

Parity against a float64 product written here, within the tolerance table's bound for `linear`
(tests/ops runs the public op on the default path through the conformance suite).
"""

import pytest
import torch

import dlinfer.vendor
from dlinfer.conformance.tolerances import tolerance

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="cpu vendor cannot load here")

PORTABLE, AVX512_BF16 = 0, 1


def _ops():
    dlinfer.vendor.load("cpu")
    return torch.ops.dlinfer_cpu


def _paths(dtype):
    return [PORTABLE] if dtype == torch.float16 else list(range(_ops().linear_16bit_best_path() + 1))


def _reference(x, w, b):
    """x [M, K] @ w[N, K]^T + b in float64, from the 16-bit values as stored."""
    out = torch.einsum("mk,nk->mn", x.double(), w.double())
    return out if b is None else out + b.double()


def _check(out, expected, dtype):
    atol, rtol = tolerance("linear", dtype)
    assert out.dtype == dtype and out.shape == expected.shape
    err = (out.double() - expected).abs()
    bound = atol + rtol * expected.abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def test_bf16_dot_product_path_is_used_where_the_cpu_has_it():
    from dlinfer.vendor.cpu import build

    flags = open("/proc/cpuinfo").read() if build.isa() == "AVX512" else ""
    assert _ops().linear_16bit_best_path() == (AVX512_BF16 if "avx512_bf16" in flags else PORTABLE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("k,n", [(1, 3), (15, 7), (16, 5), (17, 9), (31, 1), (32, 2), (33, 11), (63, 4), (100, 257),
                                 (583, 65)])
def test_parity_on_every_path(dtype, m, k, n):
    g = torch.Generator().manual_seed(m * 10007 + k * 31 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = (torch.randn(n, generator=g) * 0.5).to(dtype)
    for path in _paths(dtype):
        for bias in (None, b):
            _check(_ops().linear_few_rows_16bit(x, w, bias, path), _reference(x, w, bias), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 8])
def test_strided_rows_and_a_weight_split_across_threads(dtype, m):
    """x rows 700 elements apart (a slice of a wider buffer); a weight of ~1.4 MB, cut into bands
    between the threads, with an odd number of rows (each band's row pairs end on a single row)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 700, generator=g).to(dtype)[:, 3:579]
    w = (torch.randn(1201, 576, generator=g) / 24).to(dtype)
    b = torch.randn(1201, generator=g).to(dtype)
    assert x.stride(0) == 700
    for path in _paths(dtype):
        _check(_ops().linear_few_rows_16bit(x, w, b, path), _reference(x, w, b), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", [(100, 257), (2048, 96), (8192, 40)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype, k, n):
    """Every path gives each of 5 to 8 rows the bits of that row alone (on a Zen 1 CPU AVX2 builds
    run such calls as two passes, rows 0-3 and the rest: csrc/linear_16bit.cpp's run)."""
    g = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for m in (5, 6, 7, 8):
        x = torch.randn(m, k, generator=g).to(dtype)
        for path in _paths(dtype):
            alone = torch.cat([_ops().linear_few_rows_16bit(x[i:i + 1], w, b, path) for i in range(m)])
            assert torch.equal(_ops().linear_few_rows_16bit(x, w, b, path), alone), (m, path)


@pytest.mark.parametrize("path", [PORTABLE, AVX512_BF16])
def test_one_rounding_after_the_bias(path):
    """1 + 2^-8 lies halfway between two bf16 values. Summed in float32 with a bias of 2^-8 it
    gives 1 + 2^-7 exactly; rounding the product to bf16 before adding the bias would give 1.
    And a tie alone rounds to even: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6."""
    if path not in _paths(torch.bfloat16):
        pytest.skip("no AVX512_BF16 here")
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 2.0**-8], [1.0, 3 * 2.0**-8], [1.0, 2.0**-8]], dtype=torch.bfloat16)
    b = torch.tensor([0.0, 0.0, 2.0**-8], dtype=torch.bfloat16)
    out = _ops().linear_few_rows_16bit(x, w, b, path)
    assert out.tolist() == [[1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7]]


def test_no_rows_and_no_columns():
    for path in _paths(torch.bfloat16):
        w = torch.randn(6, 40, dtype=torch.bfloat16)
        assert _ops().linear_few_rows_16bit(torch.randn(0, 40, dtype=torch.bfloat16), w, None, path).shape == (0, 6)
        empty = torch.randn(0, 40, dtype=torch.bfloat16)
        assert _ops().linear_few_rows_16bit(torch.randn(2, 40, dtype=torch.bfloat16), empty, None, path).shape == (2, 0)


def test_bad_inputs_name_the_kernel_and_what_was_expected():
    op = _ops().linear_few_rows_16bit
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"linear_few_rows_16bit: x and weight must both be bfloat16 or both"):
        op(x, w.half(), None, -1)
    with pytest.raises(RuntimeError, match=r"linear_few_rows_16bit: at most 8 rows, got 9"):
        op(torch.randn(9, 8, dtype=torch.bfloat16), w, None, -1)
    with pytest.raises(RuntimeError, match=r"linear_few_rows_16bit: bias must be dense \[3\]"):
        op(x, w, torch.randn(4, dtype=torch.bfloat16), -1)
    with pytest.raises(RuntimeError, match=r"linear_few_rows_16bit: path 1 cannot run here for Half"):
        op(x.half(), w.half(), None, AVX512_BF16)
