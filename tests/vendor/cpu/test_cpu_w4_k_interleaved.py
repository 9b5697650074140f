"""The cpu vendor's W4A16 integer kernel on the k_interleaved layout (csrc/quant_w4_int.cpp):
the layout against the conformance suite's own packer, the hook's choice, the portable, VNNI and
AMX paths' identical bits, the documented error bound (exact integer products of each group's
activations as 31-bit fixed point), non-finite inputs, and the groups it cannot take.
Parity against the fp64 reference on every vendor: tests/ops/test_suites.py (-k weight_quant_matmul)."""

import pytest
import torch

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.conformance.reference import awq_unpack
from dlinfer.conformance.suites.weight_quant import W4Case, awq_pack, k_interleave, weights
from dlinfer.errors import InvalidArgumentError
from dlinfer.vendor import w4_layouts

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="the cpu vendor does not load here")

EPS = 2.0**-23


def _cpu():
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    return cpu_w4


PORTABLE, VNNI, AMX, BF16 = 0, 1, 2, 3  # the kernel's paths (csrc/quant_w4_ki.h's Path)
PATHS = [PORTABLE, VNNI, AMX]  # the digit paths: the same bits


def _runs_here(path, group=64):
    cpu = _cpu()
    return (path == PORTABLE or (path == VNNI and cpu.VNNI) or (path == AMX and cpu.AMX and cpu.amx_fits(group))
            or (path == BF16 and cpu.BF16_DOT))


def _kernel(x, qweight, scale, offset, group, path, bias=None):
    if not _runs_here(path, group):
        pytest.skip(f"path {path} does not run on this CPU (or at group {group})")
    return torch.ops.dlinfer_cpu.w4_matmul_k_interleaved(x, qweight, scale, offset, bias, group, path)


@pytest.mark.parametrize("k,n,group", [(8, 8, 8), (64, 200, 8), (64, 200, 32), (576, 584, 64), (160, 264, 32),
                                        (160, 264, 0), (96, 72, 48)])
def test_packers_agree_and_round_trip(k, n, group):
    """The layout module's packer, the C++ one and the suite's (written from the layout's words)
    give the same bytes, and `canonical` gives the canonical words back."""
    g = torch.Generator().manual_seed(k + n + group)
    qweight, scale, offset, _ = weights(W4Case("pack", (1,), k, n, group, fill="extreme"), torch.float32, g)
    rows = group or k
    for s, o, scale_bytes in ((scale, offset, 4), (scale.half(), None, 2), (scale.half().float(), offset, 2)):
        want = k_interleave(qweight, s, o, group)
        assert want.shape == (-(-n // 64), k // rows, 64 * scale_bytes + 64 + 32 * rows) and want.dtype == torch.uint8
        assert w4_layouts.ki_block_format(want.shape[2]) == (rows, scale_bytes)
        assert torch.equal(w4_layouts.k_interleaved(qweight, s, o, group), want)
        assert torch.equal(_cpu().k_interleaved(qweight, s, o, group), want)
        assert torch.equal(w4_layouts.canonical(want, n), qweight)


def test_value_checks_refuse_parameters_other_than_the_weight_carries():
    """The cpu kernel reads the blocks' copies; every other reader the arguments: with value checks
    on, the op refuses arguments that differ from the copies."""
    g = torch.Generator().manual_seed(17)
    qweight, scale, offset, _ = weights(W4Case("carried", (1,), 64, 72, 32), torch.float32, g)
    packed = w4_layouts.k_interleaved(qweight, scale, offset, 32)
    x = torch.randn(2, 64, generator=g)
    other_offset = w4_layouts.pack((w4_layouts.unpack(offset) + 1) % 16)
    try:
        ops.set_value_checks(True)
        ops.weight_quant_matmul(x, packed, scale, offset, None, False, 32)  # the same: accepted
        with pytest.raises(InvalidArgumentError, match="scale"):
            ops.weight_quant_matmul(x, packed, scale * 2, offset, None, False, 32)
        with pytest.raises(InvalidArgumentError, match="offset"):
            ops.weight_quant_matmul(x, packed, scale, other_offset, None, False, 32)
        with pytest.raises(InvalidArgumentError, match="offset"):
            ops.weight_quant_matmul(x, packed, scale, None, None, False, 32)  # the blocks hold the offsets
    finally:
        ops.set_value_checks(None)


def test_a_strided_k_interleaved_weight_gives_the_dense_ones_bits():
    g = torch.Generator().manual_seed(13)
    qweight, scale, offset, _ = weights(W4Case("strided", (1,), 64, 72, 32), torch.float32, g)
    dense = w4_layouts.k_interleaved(qweight, scale, offset, 32)
    wide = torch.zeros(dense.shape[0], dense.shape[1], dense.shape[2] + 64, dtype=torch.uint8)
    wide[..., :dense.shape[2]] = dense
    strided = wide[..., :dense.shape[2]]
    assert not strided.is_contiguous()
    x = torch.randn(3, 64, generator=g)
    with dlinfer.vendor.using("cpu"):
        want = ops.weight_quant_matmul(x, dense, scale, offset, None, False, 32)
        got = ops.weight_quant_matmul(x, strided, scale, offset, None, False, 32)
    assert torch.equal(got, want)


def test_layout_refuses_parameters_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"scale \[2, 8\]"):
        w4_layouts.k_interleaved(torch.zeros(16, 1, dtype=torch.int32), torch.ones(1, 8), None, 8)
    with pytest.raises(ValueError, match=r"offset \[2, 1\]"):
        w4_layouts.k_interleaved(torch.zeros(16, 1, dtype=torch.int32), torch.ones(2, 8),
                                 torch.zeros(1, 1, dtype=torch.int32), 8)


def test_layout_refuses_k_or_a_group_not_a_multiple_of_8():
    with pytest.raises(ValueError, match="K % 8"):
        w4_layouts.k_interleaved(torch.zeros(12, 1, dtype=torch.int32), torch.ones(1, 8), None, 0)
    with pytest.raises(ValueError, match="g % 8"):
        w4_layouts.k_interleaved(torch.zeros(24, 1, dtype=torch.int32), torch.ones(2, 8), None, 12)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        _cpu().k_interleaved(torch.zeros(24, 1, dtype=torch.int32), torch.ones(2, 8), None, 12)


def test_hook_picks_the_layout_the_cpu_runs_best_and_obeys_the_variable(monkeypatch):
    g = torch.Generator().manual_seed(3)
    qweight, scale, offset, _ = weights(W4Case("hook", (1,), 96, 136, 32), torch.float32, g)
    cpu = _cpu()
    monkeypatch.delenv("DLINFER_CPU_W4_ACTIVATIONS", raising=False)
    with dlinfer.vendor.using("cpu"):
        monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)  # auto: k_interleaved with VNNI and AMX
        packed = ops.repack_weight_quant(qweight, scale, offset, 32)[0]
        if cpu.VNNI and cpu.AMX:
            assert torch.equal(packed, k_interleave(qweight, scale, offset, 32))
        else:
            assert packed.dtype == torch.int32 and packed.dim() == 3
        # ... and, without AMX, for a bfloat16 model (its scales' dtype) where AVX512-BF16 runs, or on
        # an AVX2 build (its default 16-bit activations: test_cpu_w4_int16_activations.py)
        packed = ops.repack_weight_quant(qweight, scale.bfloat16(), offset, 32)[0]
        ki = cpu.VNNI and (cpu.AMX or cpu.BF16_DOT) or cpu.INT16_ACTIVATIONS
        assert packed.dtype == (torch.uint8 if ki else torch.int32)
        monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", "column_tiled")
        assert ops.repack_weight_quant(qweight, scale, offset, 32)[0].dtype == torch.int32
        monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", "k_interleaved")  # asked: wherever VNNI runs
        packed = ops.repack_weight_quant(qweight, scale, offset, 32)[0]
        assert packed.dtype == (torch.uint8 if cpu.VNNI else torch.int32)
        monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", "rows")
        with pytest.raises(ValueError, match="DLINFER_CPU_W4_LAYOUT"):
            ops.repack_weight_quant(qweight, scale, offset, 32)


@pytest.mark.parametrize("choice", ["k_interleaved", "auto"])
def test_hook_keeps_column_tiled_for_groups_the_kernel_cannot_take(choice, monkeypatch):
    monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", choice)
    assert _cpu().layout_for(96, 12) == "column_tiled"  # 12 % 8 != 0
    assert _cpu().layout_for(2048, 2048) == "column_tiled"  # past KI_MAX_GROUP
    assert _cpu().layout_for(100, 4) == "column_tiled"  # K % 8 != 0
    if choice == "auto":
        assert _cpu().layout_for(192, 96) == "column_tiled"  # AMX tiles take g % 64 == 0 or g < 64


@pytest.mark.parametrize("path", [VNNI, AMX])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n,group,zeros", [(1, 576, 960, 64, True), (3, 96, 136, 32, False),
                                               (8, 1536, 576, 128, True), (2, 64, 200, 8, True),
                                               (17, 192, 584, 64, False), (1, 1024, 72, 1024, True),
                                               (6, 96, 64, 48, True), (5, 128, 8, 16, False)])
def test_every_path_gives_the_portable_paths_bits(path, dtype, m, k, n, group, zeros):
    """Every path does the same integer products (exact) and the same float32 epilogue, in the
    same order: the portable path's bits, at any M (AMX takes 4 rows a tile instruction)."""
    g = torch.Generator().manual_seed(m + k + n)
    qweight, scale, offset, bias = weights(W4Case("paths", (m,), k, n, group, zeros, True), dtype, g)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=g)]).to(dtype)
    packed = k_interleave(qweight, scale, offset, group)
    a = _kernel(x, packed, scale, offset, group, path, bias)
    b = _kernel(x, packed, scale, offset, group, PORTABLE, bias)
    view = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(a.view(view), b.view(view))


def test_an_unavailable_path_is_refused():
    g = torch.Generator().manual_seed(2)
    qweight, scale, offset, _ = weights(W4Case("path", (1,), 192, 64, 96), torch.float32, g)
    with pytest.raises(RuntimeError, match=r"path 2 \(AMX\) cannot run here.*g = 96"):  # AMX never takes g = 96
        torch.ops.dlinfer_cpu.w4_matmul_k_interleaved(torch.randn(2, 192), k_interleave(qweight, scale, offset, 96),
                                                       scale, offset,
                                                       None, 96, 2)


def _exact(x, qweight, scale, offset, group):
    """fp64 x @ W, and the per-group terms |s * (q - z)| (for the bounds)."""
    n = scale.shape[1]
    q = awq_unpack(qweight).double()
    z = awq_unpack(offset).double() if offset is not None else torch.full_like(scale, 8, dtype=torch.float64)
    w = (q - z.repeat_interleave(group, 0)) * scale.double().repeat_interleave(group, 0)
    return x.double() @ w, w.abs().view(-1, group, n)


@pytest.mark.parametrize("path", PATHS)
def test_error_within_the_documented_bound_at_a_wide_range(path):
    """Groups whose activations span 2^24 (some elements lose bits to the group's fixed point):
    |y - exact| <= sum over groups of 2^(e_g - 31) * sum_k |w_kc| (the fixed point's rounding,
    e_g: the group's max |x| < 2^e_g) + 8 eps * sum_k |x_k w_kc| (the epilogue's float32 roundings),
    per output element; and groups within a factor 2^6 are exact up to the epilogue."""
    k, n, group = 256, 136, 64
    g = torch.Generator().manual_seed(11)
    qweight, scale, offset, _ = weights(W4Case("bound", (1,), k, n, group), torch.float32, g)
    packed = k_interleave(qweight, scale, offset, group)
    for span in (2.0**24, 2.0**5):
        x = torch.randn(4, k, generator=g).sign() * span ** torch.rand(4, k, generator=g)
        out = _kernel(x, packed, scale, offset, group, path).double()
        exact, wabs = _exact(x, qweight, scale, offset, group)
        e = torch.frexp(x.abs().view(4, -1, group).amax(-1))[1].double()  # [M, G]: max < 2^e
        fixed = (2.0 ** (e - 31)).unsqueeze(-1) * wabs.sum(1).unsqueeze(0)  # [M, G, N]
        epilogue = 8 * EPS * (x.abs().double() @ wabs.reshape(k, n))
        bound = epilogue + (fixed.sum(1) if span > 2.0**6 else 0)
        worst = ((out - exact).abs() / bound).max()
        assert ((out - exact).abs() <= bound).all(), f"span {span}: worst {worst:.2f} of the bound"


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_activations_give_nan_rows(path):
    """An inf or NaN in a row makes that row's outputs NaN (the group's factor is NaN); other rows
    are untouched."""
    g = torch.Generator().manual_seed(5)
    qweight, scale, offset, _ = weights(W4Case("nan", (3,), 64, 48, 32), torch.float32, g)
    x = torch.randn(3, 64, generator=g)
    clean = _kernel(x, k_interleave(qweight, scale, offset, 32), scale, offset, 32, path)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    out = _kernel(x, k_interleave(qweight, scale, offset, 32), scale, offset, 32, path)
    assert out[:2].isnan().all() and torch.equal(out[2], clean[2])


def test_a_group_the_kernel_cannot_take_reads_the_weight_as_canonical():
    """A k_interleaved weight with a group past the kernel's 1024 (not from the hook, which keeps
    column_tiled then) is read as canonical: the canonical call's bits."""
    g = torch.Generator().manual_seed(9)
    qweight, scale, offset, bias = weights(W4Case("g2048", (2,), 2048, 72, 2048, bias=True), torch.float32, g)
    x = torch.randn(2, 2048, generator=g)
    with dlinfer.vendor.using("cpu"):
        want = ops.weight_quant_matmul(x, qweight, scale, offset, bias, False, 2048)
        got = ops.weight_quant_matmul(x, w4_layouts.k_interleaved(qweight, scale, offset, 2048), scale, offset, bias,
                                      False, 2048)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("path", PATHS)
def test_one_group_with_power_of_two_scales_is_correctly_rounded(path):
    """The integer products are exact: with one group of 32 rows, activations within a factor of 2
    of each other (every one exact in the fixed point) and power-of-two scales, the epilogue's one
    fma gives the exact result rounded once: float32(exact), bit for bit (a float32 sum would be off
    by a few ulps; dropping any digit of the fixed point would be too)."""
    k = n = 32
    g = torch.Generator().manual_seed(21)
    qweight, _, offset, _ = weights(W4Case("exact", (1,), k, n, k), torch.float32, g)
    scale = torch.full((1, n), 2.0**-4)
    x = (torch.rand(16, k, generator=g) + 1) * torch.randint(0, 2, (16, k), generator=g).mul(2).sub(1) * 3.7
    out = _kernel(x, k_interleave(qweight, scale, offset, k), scale, offset, k, path)
    exact, _ = _exact(x, qweight, scale, offset, k)
    assert torch.equal(out, exact.float())


def test_a_bias_of_the_wrong_length_is_refused():
    """The kernel's own check (the op checks it too; tools may call the kernel directly)."""
    g = torch.Generator().manual_seed(4)
    qweight, scale, offset, _ = weights(W4Case("bias", (1,), 64, 64, 32), torch.float32, g)
    with pytest.raises(RuntimeError, match=r"bias \[N\]"):
        torch.ops.dlinfer_cpu.w4_matmul_k_interleaved(torch.randn(1, 64), k_interleave(qweight, scale, offset, 32),
                                                       scale, offset,
                                                       torch.randn(3), 32, -1)


@pytest.mark.parametrize("path", PATHS)
def test_huge_activations_do_not_overflow_before_the_result(path):
    """x near float32's largest: the fixed point's factor 2^(e - 30) meets the scale before f does
    (one fma), so a result that fits float32 comes out finite and close to the exact one."""
    k = n = 64
    qweight, offset = awq_pack(torch.full((k, n), 15)), awq_pack(torch.zeros(1, n, dtype=torch.int64))
    scale = torch.full((1, n), 1e-3)
    x = torch.zeros(1, k)
    x[0, :8] = 3e38
    out = _kernel(x, k_interleave(qweight, scale, offset, 64), scale, offset, 64, path)
    exact, _ = _exact(x, qweight, scale, offset, 64)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), exact, rtol=1e-6, atol=0)


# ---- path 3: bfloat16 activations on AVX512-BF16 (vdpbf16ps, float32 sums)

PATH3_SHAPES = [(2, 64, 200, 8), (3, 96, 136, 32), (4, 2048, 256, 128), (5, 128, 8, 16), (6, 96, 64, 48),
                (8, 1536, 576, 128), (17, 192, 584, 64), (3, 256, 200, 256)]


@pytest.mark.parametrize("m,k,n,group", PATH3_SHAPES)
def test_path3_rows_do_not_depend_on_the_batch(m, k, n, group):
    """A row's bits are the same alone and in any block of rows (blocks of 4, 3, 2, 1 differ in
    how many rows share a decode, not in any row's arithmetic), and -1 picks path 3 for bfloat16 x
    without AMX."""
    g = torch.Generator().manual_seed(m * k + n)
    qweight, scale, offset, bias = weights(W4Case("p3 batch", (m,), k, n, group, True, True), torch.bfloat16, g)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]).bfloat16()
    packed = k_interleave(qweight, scale, offset, group)
    whole = _kernel(x, packed, scale, offset, group, BF16, bias)
    alone = torch.cat([_kernel(x[i:i + 1], packed, scale, offset, group, BF16, bias) for i in range(m)])
    assert torch.equal(whole.view(torch.int16), alone.view(torch.int16))
    if not _cpu().AMX:
        best = torch.ops.dlinfer_cpu.w4_matmul_k_interleaved(x, packed, scale, offset, bias, group, -1)
        assert torch.equal(best.view(torch.int16), whole.view(torch.int16))


@pytest.mark.parametrize("m,k,n,group", PATH3_SHAPES)
def test_path3_error_within_its_bound(m, k, n, group):
    """Every product (q - z) * x is exact in float32; a group's sum rounds at most g times, the
    scale once, the sum over groups G times: |y32 - exact| <= (g + G + 2) eps * sum_k |x_k w_kc|,
    and the bfloat16 output adds half an ulp (2^-8 relative). Activations over 4 decades; and most
    outputs equal the digit paths' (the exact result rounded once), so the float32 sums are
    accurate, not merely inside the bound."""
    g = torch.Generator().manual_seed(m + k * n)
    qweight, scale, offset, _ = weights(W4Case("p3 bound", (m,), k, n, group, True), torch.bfloat16, g)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]).bfloat16()
    packed = k_interleave(qweight, scale, offset, group)
    out = _kernel(x, packed, scale, offset, group, BF16).double()
    exact, wabs = _exact(x, qweight, scale, offset, group)
    sums = (group + k // group + 2) * 2.0**-24 * (x.abs().double() @ wabs.reshape(k, n))
    bound = 2.0**-8 * (exact.abs() + sums) + sums
    assert ((out - exact).abs() <= bound).all(), f"worst {((out - exact).abs() / bound).max():.2f} of the bound"
    digits = _kernel(x, packed, scale, offset, group, PORTABLE).double()
    assert (out == digits).double().mean() >= 0.9


def test_path3_float32_block_scales():
    """Scales no float16 holds (below its normal range) stay float32 in the blocks: the same
    bound, through the kernel's float32-scale instance."""
    m, k, n, group = 4, 256, 136, 64
    g = torch.Generator().manual_seed(8)
    qweight, scale, offset, _ = weights(W4Case("p3 f32 scales", (m,), k, n, group, True), torch.bfloat16, g)
    scale = scale * 1e-6
    packed = k_interleave(qweight, scale, offset, group)
    assert w4_layouts.ki_block_format(packed.shape[2]) == (group, 4)  # float32 scales in the blocks
    x = torch.randn(m, k, generator=g).bfloat16()
    out = _kernel(x, packed, scale, offset, group, BF16).double()
    exact, wabs = _exact(x, qweight, scale, offset, group)
    sums = (group + k // group + 2) * 2.0**-24 * (x.abs().double() @ wabs.reshape(k, n))
    assert ((out - exact).abs() <= 2.0**-8 * (exact.abs() + sums) + sums).all()


def test_path3_flushes_subnormal_activations_and_overflows_past_float32():
    """The documented limits of its float32 sums (vdpbf16ps): subnormal x counts as zero, so such
    a row gives the bias exactly; x so large that a group's sum passes float32's range gives a
    non-finite row, never a wrong finite one (the digit paths give the finite result there)."""
    k = n = 64
    qweight, offset = awq_pack(torch.full((k, n), 15)), awq_pack(torch.zeros(1, n, dtype=torch.int64))
    scale = torch.full((1, n), 1e-3).bfloat16()
    bias = torch.randn(n).bfloat16()
    packed = k_interleave(qweight, scale, offset, 64)
    x = torch.full((2, k), 1e-39).bfloat16()  # subnormal in bfloat16 as in float32
    x[1] = 3e37
    out = _kernel(x, packed, scale, offset, 64, BF16, bias)
    assert torch.equal(out[0], bias)
    assert not torch.isfinite(out[1]).any()


def test_path3_zero_weights_give_exact_zeros_and_the_bias():
    """q == z everywhere: every product is an exact zero (the zero point is subtracted in bytes,
    before any float), so the output is the bias exactly, whatever x."""
    k, n, group = 128, 72, 32
    q = torch.randint(0, 16, (k // group, n), generator=torch.Generator().manual_seed(3))
    qweight, offset = awq_pack(q.repeat_interleave(group, 0)), awq_pack(q)
    scale = torch.rand(k // group, n).bfloat16()
    bias = torch.randn(n).bfloat16()
    x = (torch.randn(3, k) * 1e4).bfloat16()
    out = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group, BF16, bias)
    assert torch.equal(out, bias.expand(3, n))


def test_path3_non_finite_activations_give_nan_rows():
    """As the digit paths: an inf or NaN in a row makes that row's outputs NaN; other rows are
    untouched."""
    g = torch.Generator().manual_seed(5)
    qweight, scale, offset, _ = weights(W4Case("p3 nan", (3,), 64, 48, 32), torch.bfloat16, g)
    packed = k_interleave(qweight, scale, offset, 32)
    x = torch.randn(3, 64, generator=g).bfloat16()
    clean = _kernel(x, packed, scale, offset, 32, BF16)
    x[0, 3], x[1, 40] = float("-inf"), float("nan")
    out = _kernel(x, packed, scale, offset, 32, BF16)
    assert out[:2].isnan().all() and torch.equal(out[2], clean[2])


def test_path3_refuses_activations_other_than_bfloat16():
    g = torch.Generator().manual_seed(6)
    qweight, scale, offset, _ = weights(W4Case("p3 dtype", (1,), 64, 64, 32), torch.float32, g)
    with pytest.raises(RuntimeError, match=r"path 3 needs bfloat16 x \(got Float\)"):
        torch.ops.dlinfer_cpu.w4_matmul_k_interleaved(torch.randn(2, 64), k_interleave(qweight, scale, offset, 32),
                                                       scale, offset, None, 32, 3)
