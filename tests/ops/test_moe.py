"""moe_gating_topk_softmax and fused_moe parity."""

from dataclasses import dataclass

import pytest
import torch

import dlinfer.ops as ops

from . import reference as ref
from .cases import DEVICE, DTYPE_PARAMS, active, gen, randn, seed_of, skip_unless_supported, vendor_params
from .compare import assert_close, assert_equal


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
    return (vals / 16.0 - 8.0).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("vendor,case", vendor_params(GATE_CASES))
def test_moe_gating_topk_softmax(vendor, case, dtype):
    skip_unless_supported(vendor, dtype)
    logits = tie_free_logits(case.T, case.E, dtype, gen(seed_of("gate", case.id, dtype)))
    exp_w, exp_ids = ref.moe_gating_topk_softmax(logits, case.K)
    with active(vendor):
        w, ids = ops.moe_gating_topk_softmax(logits, case.K, None)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.device.type == DEVICE.type and ids.device.type == DEVICE.type
    assert_equal(ids, exp_ids.to(ids.device), "moe_gating_topk_softmax", name="ids")
    assert_close(w, exp_w, "moe_gating_topk_softmax", name="weights")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("vendor", vendor_params())
def test_moe_gating_topk_softmax_ties_to_lower_id(vendor, dtype):
    skip_unless_supported(vendor, dtype)
    logits = torch.tensor(
        [[0.5] * 6,
         [1.0, 3.0, 3.0, 0.0, 3.0, -1.0],
         [2.0, -1.0, 2.0, 2.0, 5.0, 2.0],
         [-4.0, -4.0, -4.0, -4.0, -4.0, -3.5]],
        dtype=dtype, device=DEVICE)
    exp_w, exp_ids = ref.moe_gating_topk_softmax(logits, 3)
    assert exp_ids.tolist() == [[0, 1, 2], [1, 2, 4], [4, 0, 2], [5, 0, 1]]
    with active(vendor):
        w, ids = ops.moe_gating_topk_softmax(logits, 3, moe_metadata=None)
    assert_equal(ids, exp_ids.to(ids.device), "moe_gating_topk_softmax", name="ids")
    assert_close(w, exp_w, "moe_gating_topk_softmax", name="weights")


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


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("vendor,case", vendor_params(MOE_CASES))
def test_fused_moe(vendor, case, dtype):
    skip_unless_supported(vendor, dtype)
    g = gen(seed_of("moe", case.id, dtype))
    x = randn((case.T, case.H), dtype, g)
    gate_up = randn((case.E, 2 * case.I, case.H), dtype, g, scale=case.H**-0.5)
    down = randn((case.E, case.H, case.I), dtype, g, scale=case.I**-0.5)
    probs = torch.softmax(torch.randn(case.T, case.E, generator=g), dim=-1)
    topk_w, topk_ids = torch.topk(probs, case.K, dim=-1)  # weights sum < 1: renormalize matters
    topk_w, topk_ids = topk_w.to(DEVICE), topk_ids.to(DEVICE)
    expected = ref.fused_moe(x, gate_up, down, topk_w, topk_ids, case.renormalize)
    with active(vendor):
        out = ops.fused_moe(x, gate_up, down, topk_w, topk_ids, case.K, case.renormalize, None, None)
    assert out.dtype == dtype and out.device.type == DEVICE.type
    assert_close(out, expected, "fused_moe")
