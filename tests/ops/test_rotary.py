"""apply_rotary_pos_emb parity (rotate-half over the first R dims, rest passes through)."""

from dataclasses import dataclass

import pytest
import torch

import dlinfer.ops as ops

from . import reference as ref
from .cases import DEVICE, DTYPE_PARAMS, active, gen, packed_qkv, seed_of, skip_unless_supported, vendor_params
from .compare import assert_close


@dataclass(frozen=True)
class RopeCase:
    id: str
    T: int
    hq: int
    hkv: int
    d: int
    r: int  # rotary dims (R <= D)
    small: bool
    packed: bool = True  # q/k as strided views of one qkv buffer (LMDeploy's split_qkv)


CASES = [
    RopeCase("t1_h4_kv1_d64", 1, 4, 1, 64, 64, True),
    RopeCase("t7_h8_kv2_d80", 7, 8, 2, 80, 80, True, packed=False),
    RopeCase("t0_h4_kv4_d128", 0, 4, 4, 128, 128, True),
    RopeCase("t5_h5_kv1_d128_r64", 5, 5, 1, 128, 64, True),
    # LMDeploy's ApplyRotaryEmb.forward_single passes a dummy key with 0 heads.
    RopeCase("t6_h3_kv0_d64", 6, 3, 0, 64, 64, True, packed=False),
    RopeCase("t300_h32_kv8_d128", 300, 32, 8, 128, 128, False),
    RopeCase("t129_h20_kv4_d80", 129, 20, 4, 80, 80, False, packed=False),
    RopeCase("t67_h10_kv2_d128_r32", 67, 10, 2, 128, 32, False),
]


def cos_sin(T, R, dtype, g):
    """LMDeploy's table: angles = pos * inv_freq, halves duplicated, cast to the activation dtype."""
    pos = torch.randint(0, 4096, (T,), generator=g).to(torch.float64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    ang = pos[:, None] * inv_freq[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(dtype=dtype, device=DEVICE), ang.sin().to(dtype=dtype, device=DEVICE)


LEAD_BATCH_CASES = [c for c in CASES if c.id in ("t7_h8_kv2_d80", "t5_h5_kv1_d128_r64")]


def _run(vendor, case, dtype, lead_batch=False):
    g = gen(seed_of("rope", case.id, dtype, lead_batch))
    q, k, _ = packed_qkv(case.T, case.hq, case.hkv, case.d, case.d, dtype, g, case.packed)
    cos, sin = cos_sin(case.T, case.r, dtype, g)
    if lead_batch:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    elif lead_batch is None:  # mixed: only the key has the leading batch dim
        k = k.unsqueeze(0)
    exp_q, exp_k = ref.apply_rotary_pos_emb(q, k, cos, sin)
    with active(vendor):
        out_q, out_k = ops.apply_rotary_pos_emb(q, k, cos, sin)
    for out, inp in ((out_q, q), (out_k, k)):
        assert out.dtype == dtype and out.device.type == DEVICE.type
        assert out.shape == inp.shape
    assert_close(out_q, exp_q, "apply_rotary_pos_emb", name="query")
    assert_close(out_k, exp_k, "apply_rotary_pos_emb", name="key")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("vendor,case", vendor_params(CASES))
def test_apply_rotary_pos_emb(vendor, case, dtype):
    skip_unless_supported(vendor, dtype)
    _run(vendor, case, dtype)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("vendor,case", vendor_params(LEAD_BATCH_CASES))
def test_apply_rotary_pos_emb_leading_batch_dim(vendor, case, dtype):
    skip_unless_supported(vendor, dtype)
    _run(vendor, case, dtype, lead_batch=True)


@pytest.mark.parametrize("vendor,case", vendor_params(LEAD_BATCH_CASES))
def test_apply_rotary_pos_emb_key_alone_with_batch_dim(vendor, case):
    """Each output keeps its own input's shape when only one of them has the batch dim."""
    _run(vendor, case, torch.float32, lead_batch=None)
