"""LMDeploy's `kernels.dlinfer.fused_moe_w8a8` on CPU: the exact call LMDeploy 0.18's W8A8 MoE layer
makes (backends/dlinfer/moe.py), with weights and scales as its loader and `update_weights` leave
them (int8 [E, out, in], scales [E, out, 1] in bfloat16 for a bfloat16 model, float32 otherwise)
and a MoE metadata object, against the float64 reference of the conformance checks (with its
per-element allowance for activations on a quantisation tie). Runs under each CPU vendor.
"""

from __future__ import annotations

import pytest
import torch
from lmdeploy.pytorch.kernels import dlinfer as kernels

import dlinfer.framework.lmdeploy_ext  # noqa: F401
import dlinfer.vendor
from dlinfer.conformance import reference as ref
from dlinfer.errors import UnsupportedError
from dlinfer.tools.tolerances import tolerance
from dlinfer.utils.type_annotation import MoeMetadata

CPU_VENDORS = [v for v in ("torch", "cpu") if v in dlinfer.vendor.available()]


@pytest.fixture(params=CPU_VENDORS, autouse=True)
def vendor(request):
    with dlinfer.vendor.using(request.param):
        yield request.param


def _layer(dtype, t=9, h=64, inter=48, experts=4, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    gate_up = torch.randint(-127, 128, (experts, 2 * inter, h), generator=g, dtype=torch.int8)
    down = torch.randint(-127, 128, (experts, h, inter), generator=g, dtype=torch.int8)
    scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # as update_weights does
    gate_up_scale = ((0.5 + torch.rand(experts, 2 * inter, 1, generator=g)) / (73 * h**0.5)).to(scale_dtype)
    down_scale = ((0.5 + torch.rand(experts, h, 1, generator=g)) / (73 * inter**0.5)).to(scale_dtype)
    weights, ids = kernels.moe_gating_topk_softmax(torch.randn(t, experts, generator=g), topk, None)
    return x, gate_up, gate_up_scale, down, down_scale, weights, ids, topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_moe_w8a8_as_lmdeploy_calls_it(dtype, renormalize):
    x, gu, gu_s, dn, dn_s, w, ids, topk = _layer(dtype)
    out = kernels.fused_moe_w8a8(x, gu, gu_s, dn, dn_s, w, ids, topk, renormalize, MoeMetadata())
    assert out.dtype == dtype and out.shape == x.shape
    expected, slack, in_doubt = ref.fused_moe_w8a8(x, gu, gu_s, dn, dn_s, w, ids, renormalize)
    assert in_doubt <= 0.01
    atol, rtol = tolerance("fused_moe_w8a8", dtype)
    err = (out.double() - expected).abs()
    assert bool((err <= atol + rtol * expected.abs() + slack).all()), float(err.max())


def test_fused_moe_w8a8_expert_parallel_is_refused():
    x, gu, gu_s, dn, dn_s, w, ids, topk = _layer(torch.float32)
    with pytest.raises(UnsupportedError, match="fused_moe_w8a8"):
        kernels.fused_moe_w8a8(x, gu, gu_s, dn, dn_s, w, ids, topk, False, MoeMetadata(ep_size=2))
