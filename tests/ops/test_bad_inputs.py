"""Rejected calls: wrong rank / size / dtype / device, bad values (value checks on) and features a
vendor lacks: InvalidArgumentError / UnsupportedError naming the op and the argument, caches untouched.

The checks: dlinfer/conformance/suites/bad_inputs.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import bad_inputs

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(bad_inputs.bad_argument))
def test_bad_argument(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(bad_inputs.bad_value))
def test_bad_value(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(bad_inputs.good_call_accepted))
def test_good_call_accepted(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(bad_inputs.good_call_accepted_no_cache))
def test_good_call_accepted_no_cache(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(bad_inputs.quantised_kv_unsupported))
def test_quantised_kv_unsupported(vendor, check):
    run(vendor, check)
