"""Bad metadata with value checks off (the production default): nothing read or written outside
a tensor (NaN sentinels around the caches), no output row left uninitialised; with value checks
on, InvalidArgumentError naming the argument.

The checks: dlinfer/conformance/suites/garbage.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import garbage

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(garbage.paged_attention_with_bad_metadata))
def test_paged_attention_with_bad_metadata(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(garbage.paged_attention_bad_metadata_rejected_with_value_checks))
def test_paged_attention_bad_metadata_rejected_with_value_checks(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(garbage.prefill_attention_with_bad_cumulative_ends))
def test_prefill_attention_with_bad_cumulative_ends(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(garbage.fill_kv_cache_with_bad_slots))
def test_fill_kv_cache_with_bad_slots(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(garbage.fill_kv_cache_bad_slots_rejected_with_value_checks))
def test_fill_kv_cache_bad_slots_rejected_with_value_checks(vendor, check):
    run(vendor, check)
