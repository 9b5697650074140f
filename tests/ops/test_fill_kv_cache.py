"""fill_kv_cache: exact copies into both layouts, nothing else touched.

The checks: dlinfer/conformance/suites/kv_cache.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import kv_cache

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(kv_cache.fill_kv_cache))
def test_fill_kv_cache(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(kv_cache.fill_kv_cache_lmdeploy_call))
def test_fill_kv_cache_lmdeploy_call(vendor, check):
    run(vendor, check)
