"""linear_w8a8_static and apply_rotary_pos_emb_interleaved: parity against float64 references and
rejected calls. The checks: dlinfer/conformance/suites/ascend_quant_rope.py."""

import pytest

from dlinfer.conformance.suites import ascend_quant_rope

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(ascend_quant_rope.linear_w8a8_static))
def test_linear_w8a8_static(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(ascend_quant_rope.apply_rotary_pos_emb_interleaved))
def test_apply_rotary_pos_emb_interleaved(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(ascend_quant_rope.ascend_quant_rope_bad_argument))
def test_ascend_quant_rope_bad_argument(vendor, check):
    run(vendor, check)
