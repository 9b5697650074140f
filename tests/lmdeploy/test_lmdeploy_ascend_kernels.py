"""LMDeploy's own dlinfer kernels for ModelSlim static W8A8 and interleaved RoPE, on CPU:
`kernels/dlinfer/w8a8_kernels.py:linear_w8a8_static` with the parameters `W8A8Linear` registers
for ModelSlim checkpoints (nn/linear/w8a8.py: input_scale [1] model dtype, input_offset [1] int8,
deq_scale [N] float32, quant_bias [N] int32) against the conformance float64 reference, and
`apply_rotary_pos_emb_interleaved` with query
and key as LMDeploy passes them, both output layouts, against a float64 rotation written here."""

from __future__ import annotations

import pytest
import torch
from lmdeploy.pytorch.kernels import dlinfer as kernels
from lmdeploy.pytorch.kernels.dlinfer.w8a8_kernels import linear_w8a8_static

import dlinfer.framework.lmdeploy_ext  # noqa: F401
import dlinfer.vendor
from dlinfer.conformance import reference as ref


@pytest.fixture(params=[v for v in ("torch", "cpu") if v in dlinfer.vendor.available()], autouse=True)
def vendor(request):
    with dlinfer.vendor.using(request.param):
        yield request.param


def test_linear_w8a8_static_modelslim_parameters():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    weight = torch.randint(-128, 128, (48, 64), generator=g).to(torch.int8)
    input_scale = torch.tensor([0.02], dtype=torch.bfloat16)
    input_offset = torch.tensor([-3], dtype=torch.int8)
    deq_scale = torch.rand(48, generator=g) / 1000
    quant_bias = torch.randint(-3000, 3000, (48,), generator=g).to(torch.int32)
    out = linear_w8a8_static(x, weight, input_scale, input_offset, deq_scale, torch.bfloat16, torch.int8, quant_bias)
    expected = ref.linear_w8a8_static(x, weight, input_scale, input_offset, deq_scale, quant_bias)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("native", [True, False])
def test_interleaved_rope_as_lmdeploy_calls_it(native):
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 4, 4, 2, 64
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    angle = torch.rand(t, d // 2, generator=g, dtype=torch.float64) * 10
    cos, sin = torch.cat([angle.cos()] * 2, -1).float(), torch.cat([angle.sin()] * 2, -1).float()
    q_out, k_out = kernels.apply_rotary_pos_emb_interleaved(q, k, cos, sin, None, None, return_native_layout=native)
    for x, out in ((q, q_out), (k, k_out)):
        a, b = x.double()[..., 0::2], x.double()[..., 1::2]
        c, s = angle.cos()[:, None], angle.sin()[:, None]
        a2, b2 = a * c - b * s, b * c + a * s
        ref = torch.cat([a2, b2], -1) if native else torch.stack([a2, b2], -1).flatten(-2)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
