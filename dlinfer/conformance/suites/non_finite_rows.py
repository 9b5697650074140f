"""Non-finite inputs through the float op families: NaN in, NaN out where the contract says, and
nothing spreads to the other rows (docs/ops.md, "Non-finite inputs"). The W8A8 family has its
own suite (non_finite.py); tests/ops/test_suites.py runs both on every vendor.

Per family, with T = 6 rows (tokens) and K = 37 features (one bad value in a kernel's vector body,
one in its scalar tail), rows 1 and 2 holding a NaN and row 3 a +inf where the family's rule
covers inf:
- rms_norm, add_rms_norm: a NaN makes every element of its row NaN (the row's sum of squares is
  NaN); an inf makes its row non-finite somewhere. add_rms_norm's residual output (x + r) is NaN
  exactly where the sum is.
- silu_and_mul: elementwise: NaN exactly at the output columns fed by a NaN gate or up value.
- apply_rotary_pos_emb: a NaN at dim j of a head makes dims j and its rotation partner NaN in
  that head of that token, nothing else.
- linear, weight_quant_matmul (W4A16): a NaN or inf in a row of x makes every column of that
  output row non-finite (NaN for NaN).
- fused_moe: a NaN token's output row is NaN in every column; the other tokens share its experts.
Every other row (token, head) equals the same op run on the input without the bad values: exactly
for the elementwise families, within the tolerance table for the reductions (a kernel may block
rows together, but a row's result must not depend on its neighbours' values).
"""

from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance.checks import PARITY, Check, params, suite
from dlinfer.conformance.compare import assert_close, assert_equal, expect
from dlinfer.conformance.inputs import device, gen, randn, seed_of
from dlinfer.conformance.suites.weight_quant import awq_pack

T, K = 6, 37
NAN_AT = {1: 5, 2: K - 1}  # row -> column of its NaN
INF_AT = {3: 7}  # row -> column of its +inf
CLEAN_ROWS = [0, 4, 5]
FAMILIES = ("rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary_pos_emb", "linear",
            "weight_quant_matmul", "fused_moe")


def _spoil(x, with_inf=True):
    """x with the NaNs (and infs) of NAN_AT / INF_AT; a column past x's last is its last."""
    bad, last = x.clone(), x.shape[-1] - 1
    for row, col in NAN_AT.items():
        bad[row, ..., min(col, last)] = float("nan")
    if with_inf:
        for row, col in INF_AT.items():
            bad[row, ..., min(col, last)] = float("inf")
    return bad


def _all_nan(t, what):
    expect(bool(torch.isnan(t).all()), f"{what} is not NaN throughout: {t.flatten()[:8].tolist()}")


def _not_finite(t, what, everywhere=False):
    bad = ~torch.isfinite(t)
    expect(bool(bad.all() if everywhere else bad.any()),
           f"{what} is {'not non-finite throughout' if everywhere else 'finite'}: {t.flatten()[:8].tolist()}")


def _clean_rows(out, ref, op, dtype, exact):
    if exact:
        assert_equal(out[CLEAN_ROWS], ref[CLEAN_ROWS], op, name="the finite rows")
    else:
        expect(bool(torch.isfinite(out[CLEAN_ROWS]).all()), f"{op}: a finite row has non-finite outputs")
        assert_close(out[CLEAN_ROWS], ref[CLEAN_ROWS], op, dtype, name="the finite rows (against the clean run)")


def _norms(op, dtype, g):
    x = randn((T, K), dtype, g, scale=2.0)
    w = (1.0 + 0.2 * torch.randn(K, generator=g, dtype=torch.float64)).to(dtype=dtype, device=device())
    bad = _spoil(x)
    if op == "rms_norm":
        out, ref = ops.rms_norm(bad, w, 1e-6), ops.rms_norm(x, w, 1e-6)
    else:
        r = randn((T, K), dtype, g)
        (out, res), (ref, ref_res) = ops.add_rms_norm(bad, r, w, 1e-6), ops.add_rms_norm(x, r, w, 1e-6)
        expect(bool(torch.equal(torch.isnan(res), torch.isnan(bad + r))), f"{op}: the residual output's NaNs "
                                                                          "are not exactly those of x + r")
        assert_equal(res[CLEAN_ROWS], ref_res[CLEAN_ROWS], op, name="the finite rows' residual")
    for row in NAN_AT:
        _all_nan(out[row], f"{op}: row {row} (a NaN in its input)")
    for row in INF_AT:
        _not_finite(out[row], f"{op}: row {row} (an inf in its input)")
    _clean_rows(out, ref, op, dtype, exact=False)


def _silu(dtype, g):
    x = randn((T, 2 * K), dtype, g, scale=2.0)
    bad = x.clone()
    bad[1, 5] = float("nan")  # a gate value
    bad[2, K + K - 1] = float("nan")  # an up value (its column K - 1)
    out, ref = ops.silu_and_mul(bad), ops.silu_and_mul(x)
    want = torch.zeros(T, K, dtype=torch.bool, device=out.device)
    want[1, 5] = want[2, K - 1] = True
    expect(bool(torch.equal(torch.isnan(out), want)), f"silu_and_mul: NaN at {torch.isnan(out).nonzero().tolist()}, "
                                                      f"expected exactly at {want.nonzero().tolist()}")
    assert_equal(out[~want], ref[~want], "silu_and_mul", name="every other element")


def _rotary(dtype, g):
    d, hq, hkv = 16, 3, 2
    q, k = randn((T, hq, d), dtype, g), randn((T, hkv, d), dtype, g)
    ang = torch.rand(T, d // 2, generator=g, dtype=torch.float64) * 10
    cos = torch.cat((ang, ang), -1).cos().to(dtype=dtype, device=device())
    sin = torch.cat((ang, ang), -1).sin().to(dtype=dtype, device=device())
    bad_q, bad_k = q.clone(), k.clone()
    bad_q[1, 2, 3] = float("nan")  # dim 3: partner 3 + d/2
    bad_k[4, 0, d - 1] = float("nan")  # dim d-1: partner d/2 - 1
    (oq, ok), (rq, rk) = ops.apply_rotary_pos_emb(bad_q, bad_k, cos, sin), ops.apply_rotary_pos_emb(q, k, cos, sin)
    for out, ref, where, name in ((oq, rq, (1, 2, (3, 3 + d // 2)), "query"),
                                  (ok, rk, (4, 0, (d - 1, d // 2 - 1)), "key")):
        want = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
        t, h, dims = where
        want[t, h, list(dims)] = True
        expect(bool(torch.equal(torch.isnan(out), want)), f"apply_rotary_pos_emb: the {name}'s NaNs at "
                                                          f"{torch.isnan(out).nonzero().tolist()}, expected "
                                                          f"{want.nonzero().tolist()}")
        assert_equal(out[~want], ref[~want], "apply_rotary_pos_emb", name=f"every other {name} element")


def _rows_through(op, dtype, out, ref, inf_rows=True):
    for row in NAN_AT:
        _all_nan(out[row], f"{op}: output row {row} (a NaN in its input row)")
    if inf_rows:
        for row in INF_AT:
            _not_finite(out[row], f"{op}: output row {row} (an inf in its input row)", everywhere=True)
    _clean_rows(out, ref, op, dtype, exact=False)


def _linear(dtype, g):
    n = 24
    x = randn((T, K), dtype, g)
    w = randn((n, K), dtype, g, scale=K ** -0.5)
    _rows_through("linear", dtype, ops.linear(_spoil(x), w), ops.linear(x, w))


def _w4(dtype, g):
    k, n, group = 64, 32, 32
    x = randn((T, k), dtype, g)
    q = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(0, 16, (k // group, n), generator=g)
    scale = ((0.5 + torch.rand(k // group, n, generator=g, dtype=torch.float64)) / 64).to(dtype=dtype, device=device())
    qweight, offset = awq_pack(q).to(device()), awq_pack(zeros).to(device())
    bad = x.clone()
    bad[1, 5], bad[2, k - 1], bad[3, 7] = float("nan"), float("nan"), float("inf")

    def run(a):
        return ops.weight_quant_matmul(a, qweight, scale, offset, group_size=group)

    _rows_through("weight_quant_matmul", dtype, run(bad), run(x))


def _moe(dtype, g):
    h, inter, e, topk = 32, 16, 4, 2
    x = randn((T, h), dtype, g)
    gate_up = randn((e, 2 * inter, h), dtype, g, scale=h ** -0.5)
    down = randn((e, h, inter), dtype, g, scale=inter ** -0.5)
    # every expert serves a NaN token and a clean one
    ids = torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3], [1, 0], [3, 2]], device=device())
    weights = torch.full((T, topk), 0.5, dtype=torch.float32, device=device())
    bad = _spoil(x, with_inf=False)

    def run(a):
        return ops.fused_moe(a, gate_up, down, weights, ids, topk, False)

    _rows_through("fused_moe", dtype, run(bad), run(x), inf_rows=False)


def _check(vendor, op, dtype):
    g = gen(seed_of("non_finite_rows", op, dtype))
    if op in ("rms_norm", "add_rms_norm"):
        _norms(op, dtype, g)
    elif op == "silu_and_mul":
        _silu(dtype, g)
    elif op == "apply_rotary_pos_emb":
        _rotary(dtype, g)
    elif op == "linear":
        _linear(dtype, g)
    elif op == "weight_quant_matmul":
        _w4(dtype, g)
    else:
        _moe(dtype, g)


@suite("non_finite_rows")
def non_finite_rows(layouts):
    return [Check("non_finite_rows", params(op, dt), op, PARITY, partial(_check, op=op, dtype=dt), case=op, dtype=dt)
            for op in FAMILIES for dt in (torch.float32, torch.bfloat16, torch.float16)]
