"""moe_gating_topk_softmax, fused_moe and fused_moe_w8a8 parity.

The checks: dlinfer/conformance/suites/moe.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import moe

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(moe.moe_gating_topk_softmax))
def test_moe_gating_topk_softmax(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(moe.moe_gating_topk_softmax_ties_to_lower_id))
def test_moe_gating_topk_softmax_ties_to_lower_id(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(moe.fused_moe))
def test_fused_moe(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(moe.fused_moe_w8a8))
def test_fused_moe_w8a8(vendor, check):
    run(vendor, check)
