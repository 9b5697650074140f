"""torch.library.opcheck on every torch.ops.dlinfer op under each vendor, with the canonical
arguments of the op table (dlinfer/vendor/op_table.py). The op list is the table's: an op added
there without samples in dlinfer/conformance/suites/opcheck.py fails.
"""

import pytest

import dlinfer.ops
from dlinfer.conformance.suites import opcheck
from dlinfer.vendor.op_table import OPS

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(opcheck.opcheck))
def test_opcheck(vendor, check):
    run(vendor, check)


def test_every_table_op_is_a_public_function():
    for name in OPS:
        assert callable(getattr(dlinfer.ops, name)), name
    assert set(OPS) <= set(dlinfer.ops.__all__)
