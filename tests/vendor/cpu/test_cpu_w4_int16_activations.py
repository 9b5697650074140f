"""The cpu vendor's W4 kernel with 16-bit activations (path 5 of w4_matmul_k_interleaved,
csrc/quant_w4_a8.cpp; opt-in: DLINFER_CPU_W4_ACTIVATIONS=int16; AVX2 builds): the quantisation rule
against an independent torch one (round half to even of x * 2^(14 - e) per row and group, e the
exponent of the group's largest |x|, at least -135), the integer sums exact, the documented error
bound against fp64 x @ W, bfloat16 x within 2^6 of its group's largest exact, rows independent of
M, non-finite, zero and tiny groups, and the setting's effect on the hook, the eager op and the
graph binding."""

import pytest
import torch
from support.w4_integer import dequantised, eager_and_bound

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.conformance.suites.weight_quant import W4Case, k_interleave, weights

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="the cpu vendor does not load here")

EPS = 2.0**-24  # float32's unit roundoff
INT16 = 5  # the kernel's path (csrc/quant_w4_ki.h's Path)
ENV = "DLINFER_CPU_W4_ACTIVATIONS"


def _cpu():
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    return cpu_w4


def _avx2():
    if not _cpu().INT16_ACTIVATIONS:
        pytest.skip("path 5 runs on AVX2 builds only")


def _kernel(x, packed, scale, offset, group, bias=None, path=INT16):
    return torch.ops.dlinfer_cpu.w4_matmul_k_interleaved(x, packed, scale, offset, bias, group, path)


@pytest.fixture
def blas_rows(monkeypatch):
    """The rows of each call the cpu vendor sends to dequantise + BLAS (`_gemm_k_interleaved`)."""
    cpu = _cpu()
    rows = []
    gemm = cpu._gemm_k_interleaved
    monkeypatch.setattr(cpu, "_gemm_k_interleaved", lambda x, *rest: rows.append(x.shape[0]) or gemm(x, *rest))
    return rows


def _quantised(x, group):
    """x [M, K] -> (X int64 [M, K], step float64 [M, G]): e = the exponent of each group's largest
    |x| (amax < 2^e), at least -135; X = round-half-even(x * 2^(14 - e)) (exact in float64: a power
    of two times a float32), step = 2^(e - 14); all-zero groups X = 0, step 0. Written from the rule
    in csrc/quant_w4_a8.cpp, in torch."""
    m, k = x.shape
    xd = x.double().view(m, k // group, group)
    amax = xd.abs().amax(-1, keepdim=True)
    e = torch.frexp(amax).exponent.clamp(min=-135).double()
    X = torch.round(xd * torch.exp2(14 - e))  # torch.round: half to even
    step = torch.where(amax > 0, torch.exp2(e - 14), torch.zeros_like(amax))
    return X.to(torch.int64).view(m, k), step.squeeze(-1)


def _model(x, qweight, scale, offset, group, bias=None):
    """fp64 sum over groups of D * float32(step * s) (D exact in int64) and the sum of the terms'
    magnitudes: the kernel rounds float(D) (|D| may pass 2^24) and each group's fma once, so it is
    within 2 G eps of that sum of magnitudes."""
    m, k = x.shape
    qz, s = dequantised(qweight, scale, offset, group)
    X, step = _quantised(x, group)
    n = s.shape[1]
    assert X.abs().max() <= 2**14
    D = torch.einsum("mgk,gkn->mgn", X.view(m, k // group, group), qz.view(k // group, group, n))  # exact int64
    factor = (step.float().unsqueeze(-1) * s.float().unsqueeze(0)).double()  # float32(step * s) [M, G, N]
    terms = D.double() * factor
    want = terms.sum(1)
    size = terms.abs().sum(1)
    if bias is not None:
        want = want + bias.double()
        size = size + bias.double().abs()
    return want, size


CASES = [(1, 576, 960, 64, True), (3, 96, 136, 32, False), (8, 1536, 576, 128, True), (2, 64, 200, 8, True),
         (17, 192, 584, 64, False), (1, 1024, 72, 1024, True), (6, 96, 64, 48, True), (5, 128, 8, 16, False),
         (4, 2048, 1024, 128, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n,group,zeros", CASES)
def test_the_integers_and_sums_follow_the_documented_rule(dtype, m, k, n, group, zeros):
    """The kernel's result is the rule's exact integer sums times float32(step * s), summed in
    float32: within 2 G eps of the terms' magnitudes, plus the output's own rounding in bfloat16 and
    float16. In float32 one integer off by one anywhere moves a result by |s (q - z)| step: at
    activations spanning 10^6, past that budget for the groups whose step is large."""
    _avx2()
    g = torch.Generator().manual_seed(m + k + n + group)
    qweight, scale, offset, bias = weights(W4Case("a16", (m,), k, n, group, zeros, True), dtype, g)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=g)]).to(dtype)
    got = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    want, size = _model(x, qweight, scale, offset, group, bias)
    output_step = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]  # half an ulp
    rounding = size * 2 * (k // group + 1) * EPS + want.abs() * output_step
    if dtype == torch.float16:
        rounding = rounding + 2.0**-24  # float16's smallest step near zero
    assert ((got.double() - want).abs() <= rounding).all()


@pytest.mark.parametrize("span", [2.0**20, 2.0**3])
def test_error_within_the_documented_bound_against_fp64(span):
    """|y - x W| <= sum_G (step_G / 2) sum_{k in G} |w_kc| + the float32 sum's rounding (each
    integer is x within half a step), at float32 activations spanning `span` inside each group; and
    half a step is at most 2^-14 of the group's largest |x| (2^(e - 15), with amax >= 2^(e - 1))."""
    _avx2()
    k, n, group, m = 512, 200, 64, 5
    g = torch.Generator().manual_seed(int(span))
    qweight, scale, offset, _ = weights(W4Case("bound", (m,), k, n, group), torch.float32, g)
    x = torch.randn(m, k, generator=g).sign() * span ** torch.rand(m, k, generator=g)
    got = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group).double()
    qz, s = dequantised(qweight, scale, offset, group)
    w = qz.double() * s.repeat_interleave(group, 0)
    exact = x.double() @ w
    _, step = _quantised(x, group)
    wabs = w.abs().view(k // group, group, n).sum(1)  # [G, N]
    rounding = 4 * (k // group + 1) * EPS * (x.double().abs() @ w.abs())
    bound = (step / 2) @ wabs + rounding
    assert ((got - exact).abs() <= bound).all()
    amax = x.double().abs().view(m, k // group, group).amax(-1)
    assert ((step / 2) <= amax * 2.0**-14).all()
    # the bound is not vacuous: the quantisation moves results by a visible fraction of it
    assert (got - exact).abs().max() > 0.05 * bound.max()


def test_bfloat16_x_near_its_group_maximum_is_exact():
    """Every bfloat16 x within a factor 2^6 of its group's largest |x| is an integer times the
    step (8 significant bits, the step 2^-14 of 2^e): the result is x @ W up to float32's rounding
    alone, as the digit paths' exact sums give."""
    _avx2()
    k, n, group, m = 256, 136, 64, 3
    g = torch.Generator().manual_seed(31)
    qweight, scale, offset, bias = weights(W4Case("exact", (m,), k, n, group, True, True), torch.float32, g)
    x = (torch.randn(m, k, generator=g).sign() * 2.0 ** (torch.rand(m, k, generator=g) * 6 - 3)).bfloat16()
    x.view(m, k // group, group)[:, :, 0] = 8.0  # each group's largest: 8, so every |x| >= 2^-3 is within 2^6
    X, step = _quantised(x, group)
    assert torch.equal(X.double() * step.repeat_interleave(group, 1), x.double())
    got = _kernel(x.float(), k_interleave(qweight, scale, offset, group), scale, offset, group, bias).double()
    qz, s = dequantised(qweight, scale, offset, group)
    terms = x.double().view(m, k // group, group, 1) * (qz.double() * s.repeat_interleave(group, 0)).view(
        1, k // group, group, n)
    exact = terms.sum((1, 2)) + bias.double()
    size = terms.sum(2).abs().sum(1) + bias.double().abs()
    assert ((got - exact).abs() <= size * 2 * (k // group + 1) * EPS).all()


@pytest.mark.parametrize("n,group", [(1000, 128), (72, 32), (4104, 64)])
def test_rows_do_not_depend_on_the_batch(n, group):
    """A row's bits are the same alone and with others: M from 1 to 9."""
    _avx2()
    k = 256
    g = torch.Generator().manual_seed(n)
    qweight, scale, offset, bias = weights(W4Case("batch", (9,), k, n, group, True, True), torch.float32, g)
    packed = k_interleave(qweight, scale, offset, group)
    x = torch.randn(9, k, generator=g)  # float32: every bit of the sums reaches the output
    alone = torch.cat([_kernel(x[i:i + 1], packed, scale, offset, group, bias) for i in range(9)])
    for m in range(1, 10):
        assert torch.equal(_kernel(x[:m], packed, scale, offset, group, bias).view(torch.int32),
                           alone[:m].view(torch.int32))


def test_float32_block_scales():
    """Scales that are not float16 values stay float32 in the blocks (the other block format)."""
    _avx2()
    k, n, group = 256, 136, 32
    g = torch.Generator().manual_seed(5)
    qweight, scale, offset, _ = weights(W4Case("f32", (3,), k, n, group), torch.float32, g)
    scale = scale * (1 + 1e-4 * torch.rand(scale.shape, generator=g))  # off the float16 grid
    packed = k_interleave(qweight, scale, offset, group)
    assert packed.shape[2] == 64 * 4 + 64 + 32 * group
    x = torch.randn(3, k, generator=g)
    want, size = _model(x, qweight, scale, offset, group)
    assert ((_kernel(x, packed, scale, offset, group).double() - want).abs() <= size * 2 * (k // group + 1) * EPS).all()


def test_non_finite_and_zero_rows():
    """A row with an inf or a NaN gives NaN everywhere; an all-zero row gives the bias exactly."""
    _avx2()
    k, n, group = 128, 72, 32
    g = torch.Generator().manual_seed(9)
    qweight, scale, offset, bias = weights(W4Case("edge", (3,), k, n, group, True, True), torch.float32, g)
    packed = k_interleave(qweight, scale, offset, group)
    x = torch.randn(3, k, generator=g)
    x[0, 5] = float("inf")
    x[1, 70] = float("nan")
    x[2] = 0
    got = _kernel(x, packed, scale, offset, group, bias)
    assert got[:2].isnan().all()
    assert torch.equal(got[2], bias.float())


@pytest.mark.parametrize("exponent", [-125, -140])
def test_tiny_groups_follow_the_rule(exponent):
    """Groups whose largest |x| is below 2^-113 (2^(14 - e) past float32: the product in double)
    and below 2^-136 (subnormal x: e held at -135, so the step 2^-149 stays a float32 and each
    subnormal is an exact integer of it): with scales of 2^100 the result is the rule's."""
    _avx2()
    k, n, group, m = 128, 72, 32, 2
    g = torch.Generator().manual_seed(10)
    qweight, _, offset, _ = weights(W4Case("tiny", (m,), k, n, group, True), torch.float32, g)
    scale = torch.rand(k // group, n, generator=g) * 2.0**100 + 2.0**99
    x = torch.randn(m, k, generator=g) * 2.0**exponent
    assert (x.abs().amax(-1) < 2.0**-113).all() and (x != 0).any()
    got = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group).double()
    want, size = _model(x, qweight, scale, offset, group)
    assert want.abs().max() > 1e-20  # the rule gives a visible result: not all zero
    assert ((got - want).abs() <= size * 2 * (k // group + 1) * EPS).all()
    if exponent == -140:  # every subnormal is an integer times 2^-149: the integers are x itself
        X, step = _quantised(x, group)
        assert torch.equal(X.double() * step.repeat_interleave(group, 1), x.double())


def test_ties_round_to_even():
    """A group whose largest |x| is 16383 has e = 14, a step of 1: x = n + 0.5 is a tie, and the
    integers are the even neighbours; one rounded away from zero would move the result by
    |s (q - z)|, far past the float32 budget."""
    _avx2()
    k, n, group = 32, 64, 32
    g = torch.Generator().manual_seed(12)
    qweight, scale, offset, _ = weights(W4Case("ties", (1,), k, n, group, True), torch.float32, g)
    ties = torch.tensor([0.5, 1.5, 2.5, -2.5, 3.5, -0.5, 16382.5, -5.5])
    x = torch.cat([torch.tensor([16383.0]), ties, torch.zeros(k - 1 - len(ties))]).view(1, k)
    X, step = _quantised(x, group)
    assert X[0, :9].tolist() == [16383, 0, 2, 2, -2, 4, 0, 16382, -6] and step.item() == 1.0
    got = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group).double()
    want, size = _model(x, qweight, scale, offset, group)
    assert ((got - want).abs() <= size * 4 * EPS).all()
    qz, s = dequantised(qweight, scale, offset, group)
    away = X.clone()
    away[0, 1:9] = torch.tensor([1, 2, 3, -3, 4, -1, 16383, -6])  # half away from zero
    assert ((away - X).double() @ (qz.double() * s.double())).abs().max() > 100 * (size * 4 * EPS).max()


def test_path_5_runs_on_avx2_builds_only():
    """Any AVX2 build, nothing else (its AVX-512 form is not written): a gate that broke would
    otherwise make every path-5 test here skip."""
    from dlinfer.vendor.cpu import build

    assert _cpu().INT16_ACTIVATIONS == (build.isa() == "AVX2")


def test_path_5_is_refused_where_it_does_not_run():
    if _cpu().INT16_ACTIVATIONS:
        pytest.skip("path 5 runs here")
    with pytest.raises(RuntimeError, match="path 5 .*AVX2 builds only"):
        _kernel(torch.randn(1, 64), torch.zeros(1, 1, 64 * 2 + 64 + 32 * 64, dtype=torch.uint8),
                torch.ones(1, 64), None, 64)


def test_the_setting_picks_the_layout_the_eager_path_and_the_graph_binding(monkeypatch):
    """int16: a float32 model's weights are k_interleaved, and the eager op and the graph binding
    give path 5's bits (not path -1's, nor path 4's)."""
    _avx2()
    k, n, group = 256, 200, 64
    g = torch.Generator().manual_seed(21)
    qweight, scale, offset, _ = weights(W4Case("setting", (2,), k, n, group), torch.float32, g)
    x = torch.randn(2, k, generator=g)
    monkeypatch.setenv(ENV, "int16")
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    packed, s, o, eager, bound = eager_and_bound(x, qweight, scale, offset, group)
    assert packed.dtype == torch.uint8  # k_interleaved
    want = _kernel(x, packed, s, o, group)
    assert torch.equal(eager, want) and torch.equal(bound, want)
    assert not torch.equal(want, _kernel(x, packed, s, o, group, path=-1))
    assert not torch.equal(want, _kernel(x, packed, s, o, group, path=4))


def test_the_setting_refuses_a_build_without_the_path(monkeypatch):
    """On any host: int16 is an error where path 5 does not run, at the hook and at the call."""
    cpu = _cpu()
    monkeypatch.setattr(cpu, "INT16_ACTIVATIONS", False)
    monkeypatch.setenv(ENV, "int16")
    with pytest.raises(ValueError, match="int16: the 16-bit activation kernel runs on AVX2 builds only"):
        cpu.layout_for(256, 64)
    with pytest.raises(ValueError, match="int16: the 16-bit activation kernel runs on AVX2 builds only"):
        cpu.kernel_path(torch.bfloat16)


def test_the_setting_refuses_a_weight_it_cannot_take(monkeypatch):
    _avx2()
    cpu = _cpu()
    monkeypatch.setenv(ENV, "int16")
    with pytest.raises(ValueError, match="int16 needs the k_interleaved layout.*K = 96 rows at group size 12"):
        cpu.layout_for(96, 12)
    monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", "column_tiled")
    with pytest.raises(ValueError, match="int16 needs the k_interleaved layout, which DLINFER_CPU_W4_LAYOUT=column"):
        cpu.layout_for(256, 64)


@pytest.mark.parametrize("n,group,zeros,half", [(200, 64, True, True), (72, 32, False, True), (1000, 128, True, False),
                                                (64, 8, True, False)])
def test_the_k_interleaved_dequantise_gives_the_float32_weight(n, group, zeros, half):
    """w4_ki_dequantise_tiles (the BLAS path's tiles) over every tile, in pieces: float32(q - z) *
    s, the product of exact float32 operands rounded once (torch's float32 multiply), zero past N:
    equal, float16 and float32 block scales, with and without zero points, a partial last tile."""
    k = 256
    g = torch.Generator().manual_seed(n + group)
    qweight, scale, offset, _ = weights(W4Case("deq", (1,), k, n, group, zeros), torch.float32, g)
    if not half:
        scale = scale * (1 + 1e-4 * torch.rand(scale.shape, generator=g))  # float32 block scales
    packed = k_interleave(qweight, scale, offset, group)
    tiles = packed.shape[0]
    pieces = [torch.ops.dlinfer_cpu.w4_ki_dequantise_tiles(packed, n, group, t0, min(tiles, t0 + 3))
              for t0 in range(0, tiles, 3)]
    got = torch.cat(pieces, 1)
    assert got.shape == (k, tiles * 64) and got.dtype == torch.float32
    qz, s = dequantised(qweight, scale, offset, group)
    want = qz.float() * s.float().repeat_interleave(group, 0)
    assert torch.equal(got[:, :n], want)
    assert not got[:, n:].any()


def test_the_k_interleaved_dequantise_refuses_bad_arguments():
    packed = torch.zeros(2, 4, 64 * 2 + 64 + 32 * 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="tile range \\[1, 3\\) of 2 tiles"):
        torch.ops.dlinfer_cpu.w4_ki_dequantise_tiles(packed, 128, 64, 1, 3)
    with pytest.raises(RuntimeError, match="qweight \\[ceil\\(N/64\\), K/g, B\\] = \\[3, K/g"):
        torch.ops.dlinfer_cpu.w4_ki_dequantise_tiles(packed, 129, 64, 0, 1)


def test_rows_past_the_switch_take_dequantise_and_blas(blas_rows, monkeypatch):
    """Under int16, weight_quant_matmul runs path 5 up to INT16_MAX_ROWS rows and the k_interleaved
    weight dequantised + BLAS past it (the graph binding leaves such call sites to the op
    function): each side takes its path, and both are within the tolerance table. The BLAS path's
    blocks are cut to one 64-column tile, so its loop over blocks runs three times."""
    _avx2()
    from dlinfer.conformance import reference as ref
    from dlinfer.conformance.compare import assert_close
    from dlinfer.vendor.cpu import graph_bindings

    cpu = _cpu()
    monkeypatch.setenv(ENV, "int16")
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    monkeypatch.setattr(cpu, "_BLOCK_BYTES", 4 * 64 * 64)  # one tile a block at K = 64
    k, n, group = 64, 136, 32
    limit = cpu.INT16_MAX_ROWS
    for m in (limit, limit + 1):
        g = torch.Generator().manual_seed(m)
        qweight, scale, offset, bias = weights(W4Case("switch", (m,), k, n, group, True, True), torch.bfloat16, g)
        x = torch.randn(m, k, generator=g).bfloat16()
        with dlinfer.vendor.using("cpu"):
            packed, s, o = ops.repack_weight_quant(qweight, scale, offset, group)
            assert packed.dtype == torch.uint8
            out = ops.weight_quant_matmul(x, packed, s, o, bias, False, group)
        assert_close(out, ref.weight_quant_matmul(x, qweight, scale, offset, bias, group), "weight_quant_matmul")
        bound = graph_bindings.weight_quant_matmul(x, packed, s, o, bias, group)
        assert (bound is None) == (m > limit)
    assert blas_rows == [limit + 1]


@pytest.mark.parametrize("build_has_path_5", [True, False])
def test_auto_takes_16_bits_for_bfloat16_models_where_path_5_runs(build_has_path_5, monkeypatch):
    """On any host (the rule itself): unset (auto), bfloat16 x takes path 5 on a build that runs it,
    float32 and float16 keep their own precision; a bfloat16 model's weights get k_interleaved
    where the kernel takes the shape and column_tiled is not asked for, else column_tiled with no
    error (auto never refuses); native keeps every dtype at its own precision."""
    cpu = _cpu()
    monkeypatch.setattr(cpu, "INT16_ACTIVATIONS", build_has_path_5)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    assert cpu.activations() == "auto"
    assert cpu.kernel_path(torch.bfloat16) == (INT16 if build_has_path_5 else -1)
    assert cpu.activations_for(torch.bfloat16) == ("int16" if build_has_path_5 else "native")
    by_bf16_path = cpu.VNNI and cpu.BF16_DOT  # the layout's own bfloat16 path (AVX-512)
    want = build_has_path_5 or cpu.VNNI and (cpu.AMX or by_bf16_path)
    assert (cpu.layout_for(256, 64, torch.bfloat16) == "k_interleaved") == want
    assert cpu.layout_for(96, 12, torch.bfloat16) == "column_tiled"  # g % 8 != 0: the kernel cannot take it
    for dtype in (torch.float32, torch.float16):
        assert cpu.kernel_path(dtype) == -1 and cpu.activations_for(dtype) == "native"
        assert (cpu.layout_for(256, 64, dtype) == "k_interleaved") == (cpu.VNNI and cpu.AMX)
    monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", "column_tiled")
    assert cpu.layout_for(256, 64, torch.bfloat16) == "column_tiled"
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT")
    monkeypatch.setenv(ENV, "native")
    assert all(cpu.kernel_path(dtype) == -1 for dtype in (torch.bfloat16, torch.float16, torch.float32))
    assert (cpu.layout_for(256, 64, torch.bfloat16) == "k_interleaved") == bool(cpu.VNNI and (cpu.AMX or by_bf16_path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_by_default_bfloat16_models_run_path_5_and_others_the_float_kernel(dtype, monkeypatch):
    """On an AVX2 build, unset: the hook gives a bfloat16 model's weight (scales in its dtype, as
    LMDeploy loads them) k_interleaved and both the eager op and the graph binding give path 5's
    bits; float32 and float16 models' weights stay column_tiled, multiplied at their own
    precision. native gives the bfloat16 model the float kernel's column_tiled bits back."""
    _avx2()
    k, n, group = 256, 200, 64
    g = torch.Generator().manual_seed(26)
    qweight, scale, offset, _ = weights(W4Case("default", (3,), k, n, group), dtype, g)
    x = torch.randn(3, k, generator=g).to(dtype)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    packed, s, o, eager, bound = eager_and_bound(x, qweight, scale.to(dtype), offset, group)
    if dtype == torch.bfloat16:
        assert packed.dtype == torch.uint8  # k_interleaved
        want = _kernel(x, packed, s, o, group)
        assert not torch.equal(want, _kernel(x, packed, s, o, group, path=-1))
    else:
        assert packed.dtype == torch.int32  # column_tiled
        want = torch.ops.dlinfer_cpu.w4_matmul(x, packed, s, o, None, group)
    assert torch.equal(eager, want) and torch.equal(bound, want)
    if dtype != torch.bfloat16:
        return
    monkeypatch.setenv(ENV, "native")
    packed, s, o, eager, bound = eager_and_bound(x, qweight, scale.to(dtype), offset, group)
    assert packed.dtype == torch.int32
    want = torch.ops.dlinfer_cpu.w4_matmul(x, packed, s, o, None, group)
    assert torch.equal(eager, want) and torch.equal(bound, want)


def test_without_vnni_x_at_its_own_precision_on_k_interleaved_takes_blas(blas_rows, monkeypatch):
    """An AVX2 build (no VNNI): a k_interleaved weight met by x at its own precision (native set
    after the hook ran, or float16 scales handed over for a float32 model under =int16's layout)
    is multiplied by BLAS on the dequantised weight, not the portable digit loop, in the eager op;
    the graph binding leaves the call site to the op function. Within the tolerance table."""
    _avx2()
    from dlinfer.conformance import reference as ref
    from dlinfer.conformance.compare import assert_close
    from dlinfer.vendor.cpu import graph_bindings

    cpu = _cpu()
    assert not cpu.VNNI
    k, n, group = 256, 200, 64
    g = torch.Generator().manual_seed(27)
    for setting, dtype in (("native", torch.bfloat16), ("auto", torch.float32), ("auto", torch.float16)):
        monkeypatch.setenv(ENV, setting)
        qweight, scale, offset, bias = weights(W4Case("blas", (2,), k, n, group, True, True), dtype, g)
        packed = k_interleave(qweight, scale, offset, group)
        x = torch.randn(2, k, generator=g).to(dtype)
        blas_rows.clear()
        with dlinfer.vendor.using("cpu"):
            out = ops.weight_quant_matmul(x, packed, scale, offset, bias, False, group)
        assert blas_rows == [2]
        assert_close(out, ref.weight_quant_matmul(x, qweight, scale, offset, bias, group), "weight_quant_matmul")
        assert graph_bindings.weight_quant_matmul(x, packed, scale, offset, bias, group) is None
