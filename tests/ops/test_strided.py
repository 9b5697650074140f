"""Inputs whose last dim is not dense: the right result, or InvalidArgumentError (never a raw
RuntimeError from a kernel).

The checks: dlinfer/conformance/suites/strided.py (shared with `python -m dlinfer conformance`).
"""

import pytest

from dlinfer.conformance.suites import strided

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(strided.strided_last_dim))
def test_strided_last_dim(vendor, check):
    run(vendor, check)
