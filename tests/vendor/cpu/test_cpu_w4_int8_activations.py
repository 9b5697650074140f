"""The cpu vendor's W4 kernel with 8-bit activations (path 4 of w4_matmul_k_interleaved,
csrc/quant_w4_a8.cpp; opt-in: DLINFER_CPU_W4_ACTIVATIONS=int8): the quantisation rule against an
independent torch one (round half to even of x * float32(127 / absmax) per row and group), the
integer sums exact, the documented error bound against fp64 x @ W, rows independent of M,
non-finite, zero and tiny groups, and the setting's effect on the hook, the eager op and the graph
binding."""

import pytest
import torch
from support.w4_integer import dequantised as _dequantised
from support.w4_integer import eager_and_bound

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.conformance.suites.weight_quant import W4Case, k_interleave, weights

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="the cpu vendor does not load here")

EPS = 2.0**-24  # float32's unit roundoff
INT8 = 4  # the kernel's path (csrc/quant_w4_ki.h's Path)
ENV = "DLINFER_CPU_W4_ACTIVATIONS"


def _cpu():
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    return cpu_w4


def _vnni():
    if not _cpu().INT8_ACTIVATIONS:
        pytest.skip("path 4 needs AVX-512 VNNI (or an AVX2 build)")


def _kernel(x, packed, scale, offset, group, bias=None, path=INT8):
    return torch.ops.dlinfer_cpu.w4_matmul_k_interleaved(x, packed, scale, offset, bias, group, path)


def _quantised(x, group):
    """x [M, K] -> (d int64 [M, K], sx float32 [M, G]): each group's bytes round-half-even of
    x * float32(127 / amax) (the float32 product rounded once), sx = float32(amax / 127); all-zero
    groups give d = 0, sx = 0; where 127 / amax overflows float32 (amax below ~2^-121) the same rule
    in double. Written from the rule in csrc/quant_w4_a8.cpp, in torch."""
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    amax = xf.abs().amax(-1, keepdim=True)
    r = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    d = torch.round(xf * r)  # torch.round: half to even
    tiny = r.isinf().expand_as(xf)
    d[tiny] = torch.round(xf.double() * (127.0 / amax.double()))[tiny].float()
    return d.to(torch.int64).view(m, k), (amax / 127.0).squeeze(-1)


def _model(x, qweight, scale, offset, group, bias=None):
    """fp64 sum over groups of D * float32(sx * s) (D exact in int64) and the sum of the terms'
    magnitudes; the kernel's float32 fma chain is within 2 G eps of that sum of magnitudes."""
    m, k = x.shape
    qz, s = _dequantised(qweight, scale, offset, group)
    d, sx = _quantised(x, group)
    n = s.shape[1]
    D = torch.einsum("mgk,gkn->mgn", d.view(m, k // group, group), qz.view(k // group, group, n))  # exact int64
    step = (sx.unsqueeze(-1) * s.float().unsqueeze(0)).double()  # float32(sx * s) [M, G, N]
    terms = D.double() * step
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
def test_the_bytes_and_sums_follow_the_documented_rule(dtype, m, k, n, group, zeros):
    """The kernel's result is the rule's exact integer sums times float32(sx * s), summed in float32:
    within 2 G eps of the terms' magnitudes (one rounding per group's fma), plus the output's own
    rounding in bfloat16 and float16. In float32 one byte off anywhere moves a result by |s (q - z)|
    sx, far past that (in bfloat16 and float16 the output's rounding can hide it where a group's sx is
    small against the result: test_ties_round_to_even is exact)."""
    _vnni()
    g = torch.Generator().manual_seed(m + k + n + group)
    qweight, scale, offset, bias = weights(W4Case("a8", (m,), k, n, group, zeros, True), dtype, g)
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
    """|y - x W| <= sum_G (sx_G / 2) sum_{k in G} |w_kc| + the float32 sum's rounding (each byte is
    x within half a step), at activations spanning `span` inside each group."""
    _vnni()
    k, n, group, m = 512, 200, 64, 5
    g = torch.Generator().manual_seed(int(span))
    qweight, scale, offset, _ = weights(W4Case("bound", (m,), k, n, group), torch.float32, g)
    x = torch.randn(m, k, generator=g).sign() * span ** torch.rand(m, k, generator=g)
    got = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group).double()
    qz, s = _dequantised(qweight, scale, offset, group)
    w = qz.double() * s.repeat_interleave(group, 0)
    exact = x.double() @ w
    _, sx = _quantised(x, group)
    wabs = w.abs().view(k // group, group, n).sum(1)  # [G, N]
    bound = (sx.double() / 2) @ wabs + 4 * (k // group + 1) * EPS * (x.double().abs() @ w.abs())
    assert ((got - exact).abs() <= bound).all()
    # the bound is not vacuous: the quantisation moves results by a visible fraction of it
    assert (got - exact).abs().max() > 0.05 * bound.max()


@pytest.mark.parametrize("n,group", [(1000, 128), (72, 32), (4104, 64)])
def test_rows_do_not_depend_on_the_batch(n, group):
    """A row's bits are the same whether it runs alone or in a block of 2, 3 or 4 rows with
    others (blocks of 4, then 3, 2 or 1): M from 1 to 9."""
    _vnni()
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
    _vnni()
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
    _vnni()
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


def test_tiny_groups_follow_the_rule_in_double():
    """Groups whose largest |x| is below ~2^-121 (127 / absmax overflows float32; x subnormal) are
    quantised by the same rule in double: with scales of 2^100, sx * s stays a normal float32 and the
    result is the rule's, as for ordinary groups (a float32 product there would give inf * x)."""
    _vnni()
    k, n, group, m = 128, 72, 32, 2
    g = torch.Generator().manual_seed(10)
    qweight, _, offset, _ = weights(W4Case("tiny", (m,), k, n, group, True), torch.float32, g)
    scale = torch.rand(k // group, n, generator=g) * 2.0**100 + 2.0**99
    x = torch.randn(m, k, generator=g) * 2.0**-135
    assert (x.abs().amax(-1) < 2.0**-121).all() and (x != 0).any()
    got = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group).double()
    want, size = _model(x, qweight, scale, offset, group)
    assert want.abs().max() > 1e-20  # the rule gives a visible result: not all zero
    assert ((got - want).abs() <= size * 2 * (k // group + 1) * EPS * 4).all()


def test_ties_round_to_even():
    """A group whose largest |x| is 127 has r = 1 exactly, so x = n + 0.5 is a tie: the bytes are
    the even neighbours (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2, 3.5 -> 4), exactly as the rule
    says; one byte rounded away from zero would move the result by |s (q - z)|."""
    _vnni()
    k, n, group = 32, 64, 32
    g = torch.Generator().manual_seed(12)
    qweight, scale, offset, _ = weights(W4Case("ties", (1,), k, n, group, True), torch.float32, g)
    ties = torch.tensor([0.5, 1.5, 2.5, -2.5, 3.5, -0.5, 126.5, -5.5])
    x = torch.cat([torch.tensor([127.0]), ties, torch.zeros(k - 1 - len(ties))]).view(1, k)
    d, sx = _quantised(x, group)
    assert d[0, :9].tolist() == [127, 0, 2, 2, -2, 4, 0, 126, -6] and sx.item() == 1.0
    got = _kernel(x, k_interleave(qweight, scale, offset, group), scale, offset, group).double()
    want, size = _model(x, qweight, scale, offset, group)
    assert ((got - want).abs() <= size * 4 * EPS).all()
    qz, s = _dequantised(qweight, scale, offset, group)
    away = d.clone()
    away[0, 1:9] = torch.tensor([1, 2, 3, -3, 4, -1, 127, -6])  # half away from zero
    assert ((away - d).double() @ (qz.double() * s.double())).abs().max() > 100 * (size * 4 * EPS).max()


def test_path_4_runs_where_the_build_and_cpu_allow():
    """VNNI on an AVX-512 build, any AVX2 build, nothing else: a gate that broke would otherwise
    make every path-4 test here skip."""
    from dlinfer.vendor.cpu import build

    isa = build.isa()
    assert _cpu().INT8_ACTIVATIONS == (_cpu().VNNI if isa == "AVX512" else isa == "AVX2")


def test_path_4_is_refused_without_vnni_or_with_a_bad_number():
    if _cpu().INT8_ACTIVATIONS:
        with pytest.raises(RuntimeError, match="path -1 \\(best\\), 0, 1, 2, 3, 4 or 5, got 6"):
            _kernel(torch.randn(1, 64), torch.zeros(1, 1, 64 * 2 + 64 + 32 * 64, dtype=torch.uint8),
                    torch.ones(1, 64), None, 64, path=6)
    else:
        with pytest.raises(RuntimeError, match="path 4 .*no AVX-512 VNNI"):
            _kernel(torch.randn(1, 64), torch.zeros(1, 1, 64 * 2 + 64 + 32 * 64, dtype=torch.uint8),
                    torch.ones(1, 64), None, 64)


def test_the_setting_picks_the_layout_the_eager_path_and_the_graph_binding(monkeypatch):
    """int8: a float32 model's weights are k_interleaved too (auto keeps column_tiled for them
    without AMX), and both the eager op and the graph binding give path 4's bits; native: path -1's
    (on AVX2, without VNNI, dequantise + BLAS)."""
    _vnni()
    from dlinfer.vendor.cpu import graph_bindings

    k, n, group = 256, 200, 64
    g = torch.Generator().manual_seed(21)
    qweight, scale, offset, _ = weights(W4Case("setting", (2,), k, n, group), torch.float32, g)
    x = torch.randn(2, k, generator=g)
    monkeypatch.setenv(ENV, "int8")
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    packed, s, o, eager, bound = eager_and_bound(x, qweight, scale, offset, group)
    assert packed.dtype == torch.uint8  # k_interleaved
    want = _kernel(x, packed, s, o, group)
    assert torch.equal(eager, want) and torch.equal(bound, want)
    assert not torch.equal(want, _kernel(x, packed, s, o, group, path=-1))  # the setting matters here
    monkeypatch.setenv(ENV, "native")
    with dlinfer.vendor.using("cpu"):
        native = ops.weight_quant_matmul(x, packed, s, o, None, False, group)
    bound = graph_bindings.weight_quant_matmul(x, packed, s, o, None, group)
    if _cpu().VNNI:
        assert torch.equal(native, _kernel(x, packed, s, o, group, path=-1))
        assert torch.equal(bound(x, packed, s, o, None, group), _kernel(x, packed, s, o, group, path=-1))
    else:  # AVX2: dequantise + BLAS, not the portable digit loop (test_cpu_w4_int16_activations.py)
        assert torch.equal(native, _cpu()._gemm_k_interleaved(x, packed, n, None, group))
        assert bound is None


def test_the_setting_refuses_a_cpu_without_vnni(monkeypatch):
    """On any host: the setting is an error where path 4 does not run (no VNNI on an AVX-512 build,
    a build below AVX2)."""
    cpu = _cpu()
    monkeypatch.setattr(cpu, "INT8_ACTIVATIONS", False)
    monkeypatch.setenv(ENV, "int8")
    with pytest.raises(ValueError, match="needs AVX-512 VNNI"):
        cpu.layout_for(256, 64)
    with pytest.raises(ValueError, match="needs AVX-512 VNNI"):
        cpu.kernel_path(torch.float32)
    monkeypatch.setenv(ENV, "native")
    assert cpu.kernel_path(torch.float32) == -1 and cpu.kernel_path(torch.bfloat16) == -1


def test_the_setting_refuses_what_it_cannot_do(monkeypatch):
    _vnni()
    cpu = _cpu()
    monkeypatch.setenv(ENV, "int4")
    with pytest.raises(ValueError, match="DLINFER_CPU_W4_ACTIVATIONS='int4': expected auto, native, int8 or int16"):
        cpu.layout_for(256, 64)
    monkeypatch.setenv(ENV, "int8")
    with pytest.raises(ValueError, match="K = 96 rows at group size 12"):
        cpu.layout_for(96, 12)
    monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", "column_tiled")
    with pytest.raises(ValueError, match="DLINFER_CPU_W4_LAYOUT=column_tiled rules out"):
        cpu.layout_for(256, 64)
