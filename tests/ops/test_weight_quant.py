"""W4A16 (`weight_quant_matmul`, LMDeploy's AWQ gemm layout): parity against the fp64 reference,
strided x, the column_tiled and k_interleaved layouts, float16 scales, bad inputs (graph mode:
tests/graph/test_weight_quant_graph.py).

The checks: dlinfer/conformance/suites/weight_quant.py (shared with `python -m dlinfer conformance`).
"""

import pytest
import torch

from dlinfer.conformance.suites import weight_quant

from .cases import run, suite_params


@pytest.mark.parametrize("vendor,check", suite_params(weight_quant.weight_quant_matmul))
def test_weight_quant_matmul(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(weight_quant.weight_quant_matmul_strided))
def test_weight_quant_matmul_strided(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(weight_quant.weight_quant_matmul_column_tiled))
def test_weight_quant_matmul_column_tiled(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(weight_quant.weight_quant_matmul_k_interleaved))
def test_weight_quant_matmul_k_interleaved(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(weight_quant.weight_quant_matmul_half_scales))
def test_weight_quant_matmul_half_scales(vendor, check):
    run(vendor, check)


@pytest.mark.parametrize("vendor,check", suite_params(weight_quant.weight_quant_matmul_bad_argument))
def test_weight_quant_matmul_bad_argument(vendor, check):
    run(vendor, check)


def test_reference_packing_matches_the_contract():
    """The suite's packer against a word written by hand: columns 0..7 = 1..8 -> nibbles in the
    order [0, 2, 4, 6, 1, 3, 5, 7], i.e. 0x86427531; a negative word (top nibble 8) round-trips."""
    from dlinfer.conformance.reference import awq_unpack

    word = weight_quant.awq_pack(torch.arange(1, 9).view(1, 8))
    assert int(word) == 0x86427531 - 2**32
    assert awq_unpack(word).tolist() == [list(range(1, 9))]

