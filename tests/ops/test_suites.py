"""Every conformance suite (dlinfer/conformance/suites, shared with `python -m dlinfer conformance`)
against every in-tree vendor that loads: one test parametrised over all suites, so a suite added to
the package runs here without a line of glue. Plus the few contract facts no suite holds."""

import pytest
import torch

import dlinfer.ops
from dlinfer.conformance.suites import checks_for, weight_quant
from dlinfer.vendor.op_table import OPS

from .cases import all_params, run


@pytest.mark.parametrize("vendor,check", all_params())
def test_conformance(vendor, check):
    run(vendor, check)


def test_check_ids_are_unique():
    for layouts in (("token_major", "head_major"), ("token_major",), ("head_major",)):
        ids = [c.id for c in checks_for(layouts)]
        assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def test_every_table_op_is_a_public_function():
    for name in OPS:
        assert callable(getattr(dlinfer.ops, name)), name
    assert set(OPS) <= set(dlinfer.ops.__all__)


def test_reference_packing_matches_the_contract():
    """The suite's packer against a word written by hand: columns 0..7 = 1..8 -> nibbles in the
    order [0, 2, 4, 6, 1, 3, 5, 7], i.e. 0x86427531; a negative word (top nibble 8) round-trips."""
    from dlinfer.conformance.reference import awq_unpack

    word = weight_quant.awq_pack(torch.arange(1, 9).view(1, 8))
    assert int(word) == 0x86427531 - 2**32
    assert awq_unpack(word).tolist() == [list(range(1, 9))]
