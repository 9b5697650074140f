"""W8A8 parity (dynamic_quant, linear_w8a8, rms_norm_w8a8, add_rms_norm_w8a8) against the fp64
references.

The checks: dlinfer/conformance/suites/quant.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import quant

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(quant.dynamic_quant))
def test_dynamic_quant(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(quant.linear_w8a8))
def test_linear_w8a8(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(quant.linear_w8a8_int_product))
def test_linear_w8a8_int_product(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(quant.rms_norm_w8a8))
def test_rms_norm_w8a8(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(quant.add_rms_norm_w8a8))
def test_add_rms_norm_w8a8(vendor, check):
    run(vendor, check)
