"""The int8 KV cache (quant_bits=8): exact quantised bytes for fill_kv_cache, and paged prefill /
decode attention over int8 caches against a float64 reference that dequantises them.

Scales and zeros come the ways LMDeploy passes them (`quant_meta`): one value for every KV head
([1]; Ascend's record file) or one per head ([Hkv]), in float32 or the activation dtype; the
caches are int8 or uint8 (what LMDeploy 0.18's cache engine allocates for quant_policy=8). The
fill cases include exact rounding ties (round half to even) and values far outside the int8
range (clamped).
"""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import PARITY, Check, params, suite
from dlinfer.conformance.compare import assert_close, assert_equal, expect
from dlinfer.conformance.inputs import DTYPES, device, gen, lens_tensor, make_block_table, packed_qkv, randn, seed_of
from dlinfer.conformance.suites.attention_cases import DECODE_CASES, PAGED_PREFILL_CASES
from dlinfer.conformance.suites.kv_cache import CASES as FILL_CASES
from dlinfer.conformance.suites.kv_cache import slots_for
from dlinfer.vendor.base import FEATURE_KV_QUANT

I8 = torch.int8


@dataclass(frozen=True)
class Scales:
    """How a case passes its scales: per head or one for all, in which dtype, cache int8/uint8."""

    id: str
    per_head: bool
    scale_dtype: torch.dtype  # None: the activation dtype
    cache_dtype: torch.dtype = I8


SCALES = [
    Scales("per_head_f32", True, torch.float32),
    Scales("one_act_dtype_uint8", False, None, torch.uint8),
]


def _scale_values(hkv, per_head, g, lo, hi):
    n = hkv if per_head else 1
    return lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)


def _quant_args(hkv, how: Scales, act_dtype, g, magnitude=3.0):
    """(k_scale, k_zero, v_scale, v_zero) on the device, [Hkv] or [1], in the case's dtype. Scales
    map about +-magnitude onto the int8 range; zeros are integers and fractions in [-6, 6]."""
    dtype = how.scale_dtype or act_dtype
    out = []
    for _ in range(2):
        scale = _scale_values(hkv, how.per_head, g, magnitude / 127, 2 * magnitude / 127)
        zero = torch.round(_scale_values(hkv, how.per_head, g, -6, 6) * 2) / 2  # halves: ties happen
        out += [scale.to(dtype).to(device()), zero.to(dtype).to(device())]
    return out


def _int8_cache(nb, bs, h, d, layout, how: Scales, g):
    """Bytes like a calibrated cache's: about 36 * N(0, 1), clamped (some at -128 and 127)."""
    shape = (nb, bs, h, d) if layout == "token_major" else (nb, h, bs, d)
    data = torch.round(randn(shape, torch.float64, g, scale=36, device="cpu")).clamp(-128, 127)
    return data.to(I8).to(device()).view(how.cache_dtype)


# ---------------------------------------------------------------- fill_kv_cache


def _fill(vendor, layout, case, dtype, how):
    g = gen(seed_of("fill_int8", case.id, dtype, layout, how.id))
    _, key, value = packed_qkv(case.T, 1, case.hkv, case.d, case.dv, dtype, g, case.packed)
    key = key * 2  # some values fall outside the int8 range: clamped
    ks, kz, vs, vz = _quant_args(case.hkv, how, dtype, g)
    key_cache = _int8_cache(case.nb, case.bs, case.hkv, case.d, layout, how, g)
    value_cache = _int8_cache(case.nb, case.bs, case.hkv, case.dv, layout, how, g)
    slots = torch.tensor(slots_for(case, g), dtype=torch.int32, device=device())
    full = [t.expand(case.hkv) for t in (ks, kz, vs, vz)]
    exp_k, exp_v = ref.fill_kv_cache_int8(key, value, key_cache, value_cache, slots, layout, *full)
    out_k, out_v = ops.fill_kv_cache(key, value, key_cache, value_cache, slots, k_scales_zeros=[ks, kz],
                                     v_scales_zeros=[vs, vz], quant_bits=8)
    expect(out_k is key_cache and out_v is value_cache, "fill_kv_cache must return the cache arguments")
    assert_equal(key_cache.view(I8), exp_k, "fill_kv_cache", name="key_cache (int8, in place)")
    assert_equal(value_cache.view(I8), exp_v, "fill_kv_cache", name="value_cache (int8, in place)")


def _fill_ties_and_clamps(vendor, layout, dtype):
    """x / scale + zero exactly k + 1/2 (power-of-two scale): ties go to the even integer; and
    values beyond +-128 clamp. Every value is exact in every activation dtype."""
    hkv, d, bs = 2, 64, 16
    k_int = torch.arange(-70, 70, dtype=torch.float64)[: d].repeat(3, hkv, 1)  # [3, Hkv, D]
    key = ((k_int + 0.5) / 4).to(dtype).to(device())  # scale 1/4, zero 0: ties at every element
    value = (torch.tensor([-1000.0, 1000.0, 31.5]).view(3, 1, 1).expand(3, hkv, d)).to(dtype).to(device())
    scale = torch.tensor([0.25, 0.25], device=device())
    zeros = torch.tensor([0.0, 1.0], device=device())  # head 1: ties shifted by one
    kc = torch.zeros((4, bs, hkv, d) if layout == "token_major" else (4, hkv, bs, d), dtype=I8, device=device())
    vc = kc.clone()
    slots = torch.tensor([5, 17, 63], device=device())
    exp_k, exp_v = ref.fill_kv_cache_int8(key, value, kc, vc, slots, layout, scale, zeros, scale, zeros)
    ops.fill_kv_cache(key, value, kc, vc, slots, k_scales_zeros=[scale, zeros], v_scales_zeros=[scale, zeros],
                      quant_bits=8)
    assert_equal(kc, exp_k, "fill_kv_cache", name="key_cache (ties to even)")
    assert_equal(vc, exp_v, "fill_kv_cache", name="value_cache (clamped)")


@suite("fill_kv_cache_int8")
def fill_kv_cache_int8(layouts):
    checks = [Check("fill_kv_cache_int8", params(layout, c.id, dt, how.id), "fill_kv_cache", PARITY,
                    partial(_fill, layout=layout, case=c, dtype=dt, how=how), case=c.id, dtype=dt, layout=layout,
                    feature=FEATURE_KV_QUANT, small=c.small)
              for layout in layouts for c in FILL_CASES for dt in DTYPES for how in SCALES]
    checks += [Check("fill_kv_cache_int8", params(layout, "ties_and_clamps", dt), "fill_kv_cache", PARITY,
                     partial(_fill_ties_and_clamps, layout=layout, dtype=dt), case="ties_and_clamps", dtype=dt,
                     layout=layout, feature=FEATURE_KV_QUANT) for layout in layouts for dt in DTYPES]
    return checks


# ---------------------------------------------------------------- paged attention


def _paged(vendor, op, layout, case, dtype, how):
    g = gen(seed_of(op, "int8", case.id, dtype, how.id))
    q, _, _ = packed_qkv(case.T, case.hq, case.hkv, case.d, case.dv, dtype, g, case.packed)
    paged = make_block_table(case.kv_lens, case.bs, g, case.index_dtype)
    key_cache = _int8_cache(paged.num_blocks, case.bs, case.hkv, case.d, layout, how, g)
    value_cache = _int8_cache(paged.num_blocks, case.bs, case.hkv, case.dv, layout, how, g)
    ks, kz, vs, vz = _quant_args(case.hkv, how, dtype, g, magnitude=2.0)  # dequantised K/V about N(0, 0.6..1.1)
    kv_scales, kv_zeros = torch.stack([ks, vs]), torch.stack([kz, vz])  # [2] or [2, Hkv]: K then V
    lens_dtype = torch.int64 if case.index_dtype == torch.int32 else torch.int32
    q_cu_ends = lens_tensor(case.cu_ends, lens_dtype, case.lens_on_cpu)
    kv_seq_len = lens_tensor(case.kv_lens, lens_dtype, case.lens_on_cpu)
    slopes = ref.alibi_slopes(case.hq).to(device()) if case.alibi else None
    full = [t.expand(case.hkv) for t in (ks, kz, vs, vz)]
    expected = ref.paged_attention(q, ref.dequantise_cache(key_cache, full[0], full[1], layout),
                                   ref.dequantise_cache(value_cache, full[2], full[3], layout), paged.block_table,
                                   case.bs, q_cu_ends, kv_seq_len, layout, case.scale, slopes, case.window,
                                   case.softcap)
    before = (key_cache.clone(), value_cache.clone())
    common = dict(head_size_v=case.dv, softmax_scale=case.scale, alibi_slopes=slopes, kv_scales=kv_scales,
                  kv_zeros=kv_zeros, quant_bits=8, **case.score_options)
    if op == "paged_prefill_attention":
        out = ops.paged_prefill_attention(q, None, None, key_cache, value_cache, paged.block_table, case.bs,
                                          q_cu_ends, kv_seq_len, max(case.q_lens), max(case.kv_lens), case.hq,
                                          case.hkv, [], **common)
    else:
        out = ops.paged_decode_attention(q, key_cache, value_cache, paged.block_table, case.bs, q_cu_ends,
                                         kv_seq_len, max(case.kv_lens), case.hq, case.hkv, **common)
    expect(out.dtype == dtype and tuple(out.shape) == (case.T, case.hq, case.dv), f"{op}: output {out.dtype} "
           f"{tuple(out.shape)}")
    assert_close(out, expected, op)
    assert_equal(key_cache, before[0], op, name="key_cache (read only)")
    assert_equal(value_cache, before[1], op, name="value_cache (read only)")


def _attention_checks(name, op, cases, layouts):
    return [Check(name, params(layout, c.id, dt, how.id), op, PARITY,
                  partial(_paged, op=op, layout=layout, case=c, dtype=dt, how=how), case=c.id, dtype=dt,
                  layout=layout, head_dim=c.d, feature=(FEATURE_KV_QUANT, *(c.features or ())), small=c.small)
            for layout in layouts for c in cases for dt in DTYPES for how in SCALES
            if not c.features or how.per_head]  # ALiBi, windows, soft caps once per case: with per-head scales


@suite("paged_decode_attention_int8")
def paged_decode_attention_int8(layouts):
    return _attention_checks("paged_decode_attention_int8", "paged_decode_attention", DECODE_CASES, layouts)


@suite("paged_prefill_attention_int8")
def paged_prefill_attention_int8(layouts):
    return _attention_checks("paged_prefill_attention_int8", "paged_prefill_attention", PAGED_PREFILL_CASES,
                             layouts)
