"""apply_rotary_pos_emb parity (rotate-half over the first R dims, rest passes through).

The checks: dlinfer/conformance/suites/rotary.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import rotary

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(rotary.apply_rotary_pos_emb))
def test_apply_rotary_pos_emb(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(rotary.apply_rotary_pos_emb_leading_batch_dim))
def test_apply_rotary_pos_emb_leading_batch_dim(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(rotary.apply_rotary_pos_emb_key_alone_with_batch_dim))
def test_apply_rotary_pos_emb_key_alone_with_batch_dim(vendor, check):
    run(vendor, check)
