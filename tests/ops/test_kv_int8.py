"""The int8 KV cache (quant_bits=8): exact quantised bytes written by fill_kv_cache, paged
prefill / decode attention over int8 caches against a float64 reference that dequantises them.

The checks: dlinfer/conformance/suites/kv_int8.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import kv_int8, kv_int8_bad

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(kv_int8.fill_kv_cache_int8))
def test_fill_kv_cache_int8(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(kv_int8.paged_decode_attention_int8))
def test_paged_decode_attention_int8(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(kv_int8.paged_prefill_attention_int8))
def test_paged_prefill_attention_int8(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(kv_int8_bad.kv_int8_bad_argument))
def test_kv_int8_bad_argument(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(kv_int8_bad.kv_int8_bad_value))
def test_kv_int8_bad_value(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(kv_int8_bad.kv_int4_refused))
def test_kv_int4_refused(vendor, check):
    run(vendor, check)
