"""apply_rotary_pos_emb parity (rotate-half over the first R dims, rest passes through)."""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import PARITY, Check, params, suite
from dlinfer.conformance.compare import assert_close, expect
from dlinfer.conformance.inputs import DTYPES, device, gen, packed_qkv, seed_of


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
    return ang.cos().to(dtype=dtype, device=device()), ang.sin().to(dtype=dtype, device=device())


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
    out_q, out_k = ops.apply_rotary_pos_emb(q, k, cos, sin)
    for name, out, inp in (("query", out_q, q), ("key", out_k, k)):
        expect(out.dtype == dtype and out.device.type == device().type,
               f"apply_rotary_pos_emb {name}: output {out.dtype} on {out.device}")
        expect(out.shape == inp.shape, f"apply_rotary_pos_emb {name}: shape {tuple(out.shape)}, expected "
                                       f"{tuple(inp.shape)}")
    assert_close(out_q, exp_q, "apply_rotary_pos_emb", name="query")
    assert_close(out_k, exp_k, "apply_rotary_pos_emb", name="key")


def _checks(name, cases, dtypes, lead_batch):
    return [Check(name, params(c.id, dt if len(dtypes) > 1 else None), "apply_rotary_pos_emb", PARITY,
                  partial(_run, case=c, dtype=dt, lead_batch=lead_batch), case=c.id, dtype=dt, small=c.small)
            for c in cases for dt in dtypes]


@suite("apply_rotary_pos_emb")
def apply_rotary_pos_emb(layouts):
    return _checks("apply_rotary_pos_emb", CASES, DTYPES, False)


@suite("apply_rotary_pos_emb_leading_batch_dim")
def apply_rotary_pos_emb_leading_batch_dim(layouts):
    return _checks("apply_rotary_pos_emb_leading_batch_dim", LEAD_BATCH_CASES, DTYPES, True)


@suite("apply_rotary_pos_emb_key_alone_with_batch_dim")
def apply_rotary_pos_emb_key_alone_with_batch_dim(layouts):
    """Each output keeps its own input's shape when only one of them has the batch dim."""
    return _checks("apply_rotary_pos_emb_key_alone_with_batch_dim", LEAD_BATCH_CASES, (torch.float32,), None)
