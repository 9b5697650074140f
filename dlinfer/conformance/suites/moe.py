"""moe_gating_topk_softmax and fused_moe parity."""

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
