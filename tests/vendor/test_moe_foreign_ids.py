"""fused_moe and fused_moe_w8a8 with value checks off: a topk id outside [0, E) adds nothing on
every vendor (the cpu and triton kernels skip such pairs; the torch vendor used to raise a raw
bincount / index error). Reference: the same call with those pairs sent to expert 0 at weight 0."""

from __future__ import annotations

import pytest
import torch

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.conformance.inputs import value_checks
from dlinfer.vendor import selection

VENDORS = [v for v in ("torch", "cpu", "triton") if v in dlinfer.vendor.available()]
T, H, I, E, K = 5, 32, 16, 4, 2


def _routing(g):
    weights = torch.rand(T, K, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[1, 0], ids[3, 1], ids[4, 0] = -1, E, E + 7
    foreign = (ids < 0) | (ids >= E)
    return weights, ids, weights.masked_fill(foreign, 0.0), ids.masked_fill(foreign, 0)


@pytest.mark.parametrize("vendor", VENDORS)
def test_fused_moe_skips_ids_outside_the_experts(vendor):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 4
    weights, ids, ref_weights, ref_ids = _routing(g)
    with selection.using(vendor), value_checks(False):
        got = ops.fused_moe(x, gate_up, down, weights, ids, K, False)
        want = ops.fused_moe(x, gate_up, down, ref_weights, ref_ids, K, False)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("vendor", VENDORS)
def test_fused_moe_w8a8_skips_ids_outside_the_experts(vendor):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    gate_up = torch.randint(-127, 128, (E, 2 * I, H), generator=g).to(torch.int8)
    down = torch.randint(-127, 128, (E, H, I), generator=g).to(torch.int8)
    gs, ds = torch.rand(E, 2 * I, generator=g) / 500, torch.rand(E, H, generator=g) / 300
    weights, ids, ref_weights, ref_ids = _routing(g)
    with selection.using(vendor), value_checks(False):
        got = ops.fused_moe_w8a8(x, gate_up, gs, down, ds, weights, ids, K, False)
        want = ops.fused_moe_w8a8(x, gate_up, gs, down, ds, ref_weights, ref_ids, K, False)
    torch.testing.assert_close(got, want)
