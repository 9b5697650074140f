"""silu_and_mul and linear parity.

The checks: dlinfer/conformance/suites/activation.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import activation

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(activation.silu_and_mul))
def test_silu_and_mul(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(activation.silu_and_mul_strided_rows))
def test_silu_and_mul_strided_rows(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(activation.linear))
def test_linear(vendor, check):
    run(vendor, check)
