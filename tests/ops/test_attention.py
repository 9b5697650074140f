"""prefill_attention, paged_prefill_attention and paged_decode_attention parity.

The checks: dlinfer/conformance/suites/attention.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import attention

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(attention.prefill_attention))
def test_prefill_attention(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(attention.prefill_attention_no_caches))
def test_prefill_attention_no_caches(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(attention.paged_prefill_attention))
def test_paged_prefill_attention(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(attention.paged_decode_attention))
def test_paged_decode_attention(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(attention.paged_attention_nan_in_unused_slots))
def test_paged_attention_nan_in_unused_slots(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(attention.attention_empty_batch))
def test_attention_empty_batch(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(attention.lmdeploy_layer_steps))
def test_lmdeploy_layer_steps(vendor, check):
    run(vendor, check)
