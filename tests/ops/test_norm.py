"""rms_norm / add_rms_norm parity against the fp64 reference.

The checks: dlinfer/conformance/suites/norm.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import norm

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(norm.rms_norm))
def test_rms_norm(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(norm.add_rms_norm))
def test_add_rms_norm(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(norm.rms_norm_strided_rows))
def test_rms_norm_strided_rows(vendor, check):
    run(vendor, check)
