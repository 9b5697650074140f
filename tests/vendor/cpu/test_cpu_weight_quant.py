"""The cpu vendor's W4A16 load-time repack: canonical and column_tiled weights give the same
output bits (few-rows kernel and the GEMM path), the hook is what `dlinfer.ops.
repack_weight_quant` returns on CPU, and the torch vendor has none; thread counts and batches do
not change a row's bits in either repacked layout (the k_interleaved kernel's own tests:
test_cpu_w4_k_interleaved.py)."""

import pytest
import torch

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.conformance.suites.weight_quant import W4Case, column_tile, weights

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="the cpu vendor does not load here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n,group,zeros", [(1, 576, 1536, 64, True), (1, 96, 136, 32, False),
                                               (1, 160, 264, 0, True), (1, 1536, 576, 64, False),
                                               (1, 64, 200, 32, True), (1, 128, 192, 64, False),
                                               (2, 96, 136, 32, False),
                                               (3, 160, 264, 0, True), (7, 80, 48, 16, True),
                                               (8, 1536, 576, 128, True), (9, 256, 392, 128, False),
                                               (33, 192, 128, 64, True), (4100, 64, 136, 32, True)])
def test_repacked_and_canonical_identical_bits(dtype, m, k, n, group, zeros, monkeypatch):
    monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", "column_tiled")
    g = torch.Generator().manual_seed(m * 1000 + n)
    qweight, scale, offset, bias = weights(W4Case("bits", (m,), k, n, group, zeros, True), dtype, g)
    x = (torch.randn(m, k, generator=g)).to(dtype)
    with dlinfer.vendor.using("cpu"):
        tiled, scale2, offset2 = ops.repack_weight_quant(qweight, scale, offset, group)
        assert tiled.shape == (-(-n // 128), k, 16) and tiled.dtype == torch.int32
        assert torch.equal(tiled, column_tile(qweight))  # the layout, as the suite spells it
        assert scale2 is scale and offset2 is offset
        a = ops.weight_quant_matmul(x, qweight, scale, offset, bias, False, group)
        b = ops.weight_quant_matmul(x, tiled, scale2, offset2, bias, False, group)
        assert ops.repack_weight_quant(tiled, scale2, offset2, group)[0] is tiled  # repacked already
    assert torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       b.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("m,k,n,group", [(1, 576, 576, 64), (1, 96, 136, 32), (9, 1536, 576, 64), (4100, 64, 136, 32)])
@pytest.mark.parametrize("layout", ["column_tiled", "k_interleaved"])
def test_repack_keeps_float16_exact_scales_as_float16(m, k, n, group, layout, monkeypatch):
    """AWQ checkpoints' scales are float16 values held as float32: the hook stores them as float16,
    and the outputs keep their bits (the kernels widen them back exactly)."""
    monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", layout)
    g = torch.Generator().manual_seed(k + n)
    qweight, scale, offset, bias = weights(W4Case("half", (m,), k, n, group, True, True), torch.float32, g)
    scale = scale.to(torch.float16).to(torch.float32)
    x = torch.randn(m, k, generator=g)
    with dlinfer.vendor.using("cpu"):
        tiled, half, offset2 = ops.repack_weight_quant(qweight, scale, offset, group)
        assert half.dtype == torch.float16 and torch.equal(half.to(torch.float32), scale)
        a = ops.weight_quant_matmul(x, tiled, scale, offset, bias, False, group)
        b = ops.weight_quant_matmul(x, tiled, half, offset2, bias, False, group)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_repack_refuses_a_hook_that_changes_scale_values(monkeypatch):
    g = torch.Generator().manual_seed(0)
    qweight, scale, offset, _ = weights(W4Case("hook", (1,), 64, 48, 32), torch.float32, g)
    import dataclasses

    import dlinfer.ops.weight_quant as wq

    def lossy(q, s, z, gs):  # rounds scales that are not float16 values
        return q, s.to(torch.float16), z

    vendor = dataclasses.replace(dlinfer.vendor.load("cpu"), repack_weight_quant=lossy)
    monkeypatch.setattr(wq, "resolve", lambda op, device_type: (None, vendor))
    with dlinfer.vendor.using("cpu"), pytest.raises(ValueError, match=r"repack_weight_quant.*scale.*same values"):
        ops.repack_weight_quant(qweight, scale, offset, 32)


def test_torch_vendor_has_no_repack_hook():
    g = torch.Generator().manual_seed(0)
    qweight, scale, offset, _ = weights(W4Case("hook", (1,), 64, 48, 32), torch.float32, g)
    assert dlinfer.vendor.load("torch").repack_weight_quant is None
    with dlinfer.vendor.using("torch"):
        out = ops.repack_weight_quant(qweight, scale, offset, 32)
    assert out[0] is qweight and out[1] is scale and out[2] is offset


def test_repack_checks_its_arguments():
    g = torch.Generator().manual_seed(0)
    qweight, scale, offset, _ = weights(W4Case("hook", (1,), 64, 48, 32), torch.float32, g)
    with pytest.raises(ValueError, match=r"repack_weight_quant.*group_size"):
        ops.repack_weight_quant(qweight, scale, offset, 48)
    with pytest.raises(ValueError, match=r"repack_weight_quant.*qweight"):
        ops.repack_weight_quant(qweight.to(torch.int64), scale, offset, 32)


# Shapes above the kernel's parallel threshold (K * N / 2 >= 64 KB), so 2 and 3 threads really
# split the work: few tiles (split groups) at M = 1, 8 (one row block), 9 and 20 (several), and a
# shape with 12 tiles (no split).
_SHAPES = [(1, 576, 576, 64), (1, 1536, 576, 64), (8, 576, 392, 32), (9, 576, 576, 64), (20, 1536, 136, 128),
           (3, 576, 1536, 64)]


@pytest.fixture(params=["column_tiled", "k_interleaved"])
def layout(request, monkeypatch):
    """The hook's layout for the test (k_interleaved where the VNNI kernel runs, else skipped)."""
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    if request.param == "k_interleaved" and not cpu_w4.VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI: the hook never gives k_interleaved here")
    monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", request.param)
    return request.param


def _repacked(m, k, n, group, seed):
    g = torch.Generator().manual_seed(seed)
    qweight, scale, offset, bias = weights(W4Case("bits", (m,), k, n, group, True, True), torch.float32, g)
    with dlinfer.vendor.using("cpu"):
        tiled, scale, offset = ops.repack_weight_quant(qweight, scale, offset, group)
    return torch.randn(m, k, generator=g), (tiled, scale, offset, bias)


def _w4(x, packed, group):
    tiled, scale, offset, bias = packed
    with dlinfer.vendor.using("cpu"):
        return ops.weight_quant_matmul(x, tiled, scale, offset, bias, False, group)


@pytest.mark.parametrize("m,k,n,group", _SHAPES)
def test_same_bits_at_every_thread_count(m, k, n, group, layout):
    """Few-tile shapes split each tile's groups into two work items (csrc/quant_w4.cpp,
    kSplitBelowTiles): the split follows the shape, not the threads, so 1, 2 and 3 threads give
    the same bits. (Past the build's switch, on portable builds from 2 rows, BLAS multiplies the
    dequantised weight, and its bits follow its own threading.)"""
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    if layout == "column_tiled" and m > cpu_w4.GEMV_MAX_ROWS:
        pytest.skip(f"{m} rows take dequantise + BLAS in this build (past its {cpu_w4.GEMV_MAX_ROWS}-row switch)")
    x, packed = _repacked(m, k, n, group, k + n + m)
    assert packed[0].dtype == (torch.uint8 if layout == "k_interleaved" else torch.int32)
    saved = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(_w4(x, packed, group))
    finally:
        torch.set_num_threads(saved)
    for out in outs[1:]:
        assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))


@pytest.mark.parametrize("m,k,n,group", _SHAPES)
def test_a_row_has_the_same_bits_in_any_batch(m, k, n, group, layout):
    """A row's output does not depend on the other rows of the call: alone, in the first row
    block, or in a batch of several blocks (the kernel's split and its row blocks never change a
    row's arithmetic). Up to the build's switch: past it BLAS multiplies the dequantised weight."""
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    total = max(m, 17)
    if layout == "column_tiled" and total > cpu_w4.GEMV_MAX_ROWS:
        pytest.skip(f"{total} rows take dequantise + BLAS in this build (past its {cpu_w4.GEMV_MAX_ROWS}-row switch)")
    x, packed = _repacked(total, k, n, group, k + n)
    assert packed[0].dtype == (torch.uint8 if layout == "k_interleaved" else torch.int32)
    whole = _w4(x, packed, group)
    for rows in (1, 2, 3, 5, 8, 9):  # every row block kind (AVX2 blocks 4 rows, the others 8)
        part = _w4(x[:rows].contiguous(), packed, group)
        assert torch.equal(part.view(torch.int32), whole[:rows].view(torch.int32)), rows


@pytest.mark.parametrize("m", [1, 4100])  # the register kernel and the dequantise + GEMM path
def test_strided_weight_tensors_give_the_dense_ones_bits(m):
    """The kernels make qweight, scale and offset dense themselves (the vendor's wrapper no longer
    does): strided views of the same values give the same output bits."""
    g = torch.Generator().manual_seed(m)
    k, n, group = 128, 136, 32
    qweight, scale, offset, bias = weights(W4Case("strided", (m,), k, n, group, True, True), torch.float32, g)
    x = torch.randn(m, k, generator=g)

    def strided(t):  # the same values, every other column of a twice-as-wide tensor
        wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
        wide[:, ::2] = t
        view = wide[:, ::2]
        assert not view.is_contiguous() and torch.equal(view, t)
        return view

    with dlinfer.vendor.using("cpu"):
        want = ops.weight_quant_matmul(x, qweight, scale, offset, bias, False, group)
        got = ops.weight_quant_matmul(x, strided(qweight), strided(scale), strided(offset), bias, False, group)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_rows_on_either_side_of_the_blas_switch_match_the_reference(monkeypatch):
    """weight_quant_matmul runs the register kernel up to GEMV_MAX_ROWS rows (the build's switch,
    csrc/quant_w4.h: 4096 on AVX-512, 128 on AVX2, 1 on portable builds) and dequantise + BLAS past
    it: each side takes the path it should, the kernel refuses one row more than its limit, and both
    sides are within the tolerance table."""
    from dlinfer.conformance import reference as ref
    from dlinfer.conformance.compare import assert_close
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    monkeypatch.setenv(cpu_w4.LAYOUT_ENV, "column_tiled")  # the register kernel's layout on every CPU
    monkeypatch.delenv(cpu_w4.ACTIVATIONS_ENV, raising=False)
    blas_rows = []
    gemm = cpu_w4._gemm
    monkeypatch.setattr(cpu_w4, "_gemm", lambda x, *rest: blas_rows.append(x.shape[0]) or gemm(x, *rest))
    k, n, group = 64, 136, 32
    limit = cpu_w4.GEMV_MAX_ROWS
    for m in (limit, limit + 1):
        g = torch.Generator().manual_seed(m)
        qweight, scale, offset, bias = weights(W4Case("switch", (m,), k, n, group, True, True), torch.bfloat16, g)
        x = torch.randn(m, k, generator=g).bfloat16()
        with dlinfer.vendor.using("cpu"):
            tiled, scale2, offset2 = ops.repack_weight_quant(qweight, scale, offset, group)
            assert tiled.dim() == 3 and tiled.dtype == torch.int32  # column_tiled
            out = ops.weight_quant_matmul(x, tiled, scale2, offset2, bias, False, group)
        assert_close(out, ref.weight_quant_matmul(x, qweight, scale, offset, bias, group), "weight_quant_matmul")
    assert blas_rows == [limit + 1]
    with pytest.raises(RuntimeError, match=f"M <= {limit}"):
        cpu_w4._w4_matmul(x, tiled, scale2, offset2, bias, group)  # limit + 1 rows
