"""moe_gating_topk_softmax, fused_moe and fused_moe_w8a8 parity."""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import PARITY, Check, params, suite
from dlinfer.conformance.compare import assert_close, assert_equal, expect
from dlinfer.conformance.inputs import DTYPES, device, gen, randn, seed_of


@dataclass(frozen=True)
class GateCase:
    id: str
    T: int
    E: int
    K: int
    small: bool


GATE_CASES = [
    GateCase("t1_e8_k2", 1, 8, 2, True),
    GateCase("t13_e60_k4", 13, 60, 4, True),
    GateCase("t0_e8_k2", 0, 8, 2, True),
    GateCase("t7_e5_k5", 7, 5, 5, True),
    GateCase("t5_e7_k1", 5, 7, 1, True),
    GateCase("t257_e64_k6", 257, 64, 6, False),
    GateCase("t100_e128_k8", 100, 128, 8, False),
]


def tie_free_logits(T, E, dtype, g):
    """Distinct values per row, exact in every dtype (k / 16 for distinct k < 256)."""
    rows = [torch.randperm(256, generator=g)[:E] for _ in range(T)]
    vals = torch.stack(rows).to(torch.float64) if T else torch.zeros(0, E, dtype=torch.float64)
    return (vals / 16.0 - 8.0).to(dtype=dtype, device=device())


def _check_gate_outputs(w, ids, exp_w, exp_ids):
    op = "moe_gating_topk_softmax"
    expect(w.dtype == torch.float32 and ids.dtype == torch.int64, f"{op}: outputs {w.dtype}, {ids.dtype}")
    expect(w.device.type == device().type and ids.device.type == device().type,
           f"{op}: outputs on {w.device}, {ids.device}")
    assert_equal(ids, exp_ids.to(ids.device), op, name="ids")
    assert_close(w, exp_w, op, name="weights")


def _gate(vendor, case, dtype):
    logits = tie_free_logits(case.T, case.E, dtype, gen(seed_of("gate", case.id, dtype)))
    exp_w, exp_ids = ref.moe_gating_topk_softmax(logits, case.K)
    w, ids = ops.moe_gating_topk_softmax(logits, case.K, None)
    _check_gate_outputs(w, ids, exp_w, exp_ids)


@suite("moe_gating_topk_softmax")
def moe_gating_topk_softmax(layouts):
    return [Check("moe_gating_topk_softmax", params(c.id, dt), "moe_gating_topk_softmax", PARITY,
                  partial(_gate, case=c, dtype=dt), case=c.id, dtype=dt, small=c.small)
            for c in GATE_CASES for dt in DTYPES]


def _ties(vendor, dtype):
    logits = torch.tensor(
        [[0.5] * 6,
         [1.0, 3.0, 3.0, 0.0, 3.0, -1.0],
         [2.0, -1.0, 2.0, 2.0, 5.0, 2.0],
         [-4.0, -4.0, -4.0, -4.0, -4.0, -3.5]],
        dtype=dtype, device=device())
    exp_w, exp_ids = ref.moe_gating_topk_softmax(logits, 3)
    w, ids = ops.moe_gating_topk_softmax(logits, 3, moe_metadata=None)
    _check_gate_outputs(w, ids, exp_w, exp_ids)


@suite("moe_gating_topk_softmax_ties_to_lower_id")
def moe_gating_topk_softmax_ties_to_lower_id(layouts):
    return [Check("moe_gating_topk_softmax_ties_to_lower_id", params(dt), "moe_gating_topk_softmax", PARITY,
                  partial(_ties, dtype=dt), case="ties", dtype=dt) for dt in DTYPES]


@dataclass(frozen=True)
class MoeCase:
    id: str
    T: int
    H: int
    I: int  # noqa: E741
    E: int
    K: int
    renormalize: bool
    small: bool


MOE_CASES = [
    MoeCase("t1_h64_i80_e4_k2", 1, 64, 80, 4, 2, False, True),
    MoeCase("t7_h96_i48_e8_k2_renorm", 7, 96, 48, 8, 2, True, True),
    MoeCase("t0_h64_i32_e4_k2", 0, 64, 32, 4, 2, True, True),
    MoeCase("t5_h128_i64_e5_k5", 5, 128, 64, 5, 5, False, True),
    MoeCase("t37_h512_i704_e16_k4", 37, 512, 704, 16, 4, False, False),
    MoeCase("t100_h256_i320_e60_k2_renorm", 100, 256, 320, 60, 2, True, False),
]


def _fused_moe(vendor, case, dtype):
    g = gen(seed_of("moe", case.id, dtype))
    x = randn((case.T, case.H), dtype, g)
    gate_up = randn((case.E, 2 * case.I, case.H), dtype, g, scale=case.H**-0.5)
    down = randn((case.E, case.H, case.I), dtype, g, scale=case.I**-0.5)
    probs = torch.softmax(torch.randn(case.T, case.E, generator=g), dim=-1)
    topk_w, topk_ids = torch.topk(probs, case.K, dim=-1)  # weights sum < 1: renormalize matters
    topk_w, topk_ids = topk_w.to(device()), topk_ids.to(device())
    expected = ref.fused_moe(x, gate_up, down, topk_w, topk_ids, case.renormalize)
    out = ops.fused_moe(x, gate_up, down, topk_w, topk_ids, case.K, case.renormalize, None, None)
    expect(out.dtype == dtype and out.device.type == device().type, f"fused_moe: output {out.dtype} on {out.device}")
    assert_close(out, expected, "fused_moe")


@suite("fused_moe")
def fused_moe(layouts):
    return [Check("fused_moe", params(c.id, dt), "fused_moe", PARITY, partial(_fused_moe, case=c, dtype=dt),
                  case=c.id, dtype=dt, small=c.small) for c in MOE_CASES for dt in DTYPES]


@dataclass(frozen=True)
class MoeW8A8Case:
    id: str
    T: int
    H: int
    I: int  # noqa: E741
    E: int
    K: int
    renormalize: bool
    scale_col: bool  # scales [E, rows, 1] in bfloat16 (LMDeploy's bf16 models), else [E, rows] float32
    small: bool


MOE_W8A8_CASES = [
    MoeW8A8Case("t1_h64_i80_e4_k2", 1, 64, 80, 4, 2, False, False, True),
    MoeW8A8Case("t7_h77_i45_e8_k2_renorm", 7, 77, 45, 8, 2, True, True, True),
    MoeW8A8Case("t0_h64_i32_e4_k2", 0, 64, 32, 4, 2, True, False, True),
    MoeW8A8Case("t6_h128_i64_e5_k5", 6, 128, 64, 5, 5, False, True, True),
    MoeW8A8Case("t9_h19_i7_e3_k1", 9, 19, 7, 3, 1, True, False, True),
    MoeW8A8Case("t37_h512_i704_e16_k4", 37, 512, 704, 16, 4, False, True, False),
    MoeW8A8Case("t64_h576_i1536_e8_k2_renorm", 64, 576, 1536, 8, 2, True, False, False),
]


def _channel_scales(e, rows, fan_in, col, g):
    """Scales that make int8 weights (std ~73) dequantise to std ~fan_in**-0.5."""
    s = ((0.5 + torch.rand(e, rows, generator=g, dtype=torch.float64)) / (73.0 * fan_in**0.5))
    s = s.to(torch.bfloat16).unsqueeze(-1) if col else s.to(torch.float32)
    return s.to(device())


def _fused_moe_w8a8(vendor, case, dtype):
    from dlinfer.conformance.suites.quant import _int8

    g = gen(seed_of("moe_w8a8", case.id, dtype))
    x = randn((case.T, case.H), dtype, g, scale=1.5)
    if case.T > 3:
        x[0] = 0  # a zero token: scale 0, no NaN
        x[1, case.H // 2] = 40.0  # one huge value: the rest of the token quantises to few steps
    gate_up, down = _int8((case.E, 2 * case.I, case.H), g), _int8((case.E, case.H, case.I), g)
    gu_s = _channel_scales(case.E, 2 * case.I, case.H, case.scale_col, g)
    dn_s = _channel_scales(case.E, case.H, case.I, case.scale_col, g)
    probs = torch.softmax(torch.randn(case.T, case.E, generator=g), dim=-1)
    topk_w, topk_ids = torch.topk(probs, case.K, dim=-1)  # weights sum < 1: renormalize matters
    topk_w, topk_ids = topk_w.to(device()), topk_ids.to(device())
    expected, slack, in_doubt = ref.fused_moe_w8a8(x, gate_up, gu_s, down, dn_s, topk_w, topk_ids, case.renormalize)
    expect(in_doubt <= 0.01, f"fused_moe_w8a8 check: {in_doubt:.2%} of the activations sit on quantisation ties")
    out = ops.fused_moe_w8a8(x, gate_up, gu_s, down, dn_s, topk_w, topk_ids, case.K, case.renormalize, None)
    expect(out.dtype == dtype and out.device.type == device().type,
           f"fused_moe_w8a8: output {out.dtype} on {out.device}")
    assert_close(out, expected, "fused_moe_w8a8", slack=slack)


@suite("fused_moe_w8a8")
def fused_moe_w8a8(layouts):
    return [Check("fused_moe_w8a8", params(c.id, dt), "fused_moe_w8a8", PARITY,
                  partial(_fused_moe_w8a8, case=c, dtype=dt), case=c.id, dtype=dt, small=c.small)
            for c in MOE_W8A8_CASES for dt in DTYPES]
