"""fill_kv_cache: exact copies into both layouts, nothing else touched."""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import PARITY, Check, params, suite
from dlinfer.conformance.compare import assert_equal, expect
from dlinfer.conformance.inputs import DTYPES, alloc_cache, device, gen, packed_qkv, seed_of


@dataclass(frozen=True)
class FillCase:
    id: str
    T: int
    hkv: int
    d: int
    dv: int
    bs: int
    nb: int
    small: bool
    contiguous_run: bool = False  # a prefill: consecutive positions through shuffled blocks
    packed: bool = True
    latent: bool = False  # MLA: value = key[..., :Dv] and value_cache = key_cache[..., :Dv] (views)


CASES = [
    FillCase("t1_kv1_d64_bs16", 1, 1, 64, 64, 16, 3, True),
    FillCase("t7_kv2_d80_bs16", 7, 2, 80, 80, 16, 4, True, packed=False),
    FillCase("t0_kv2_d64_bs16", 0, 2, 64, 64, 16, 2, True),
    FillCase("t5_kv1_d128_dv64_bs8", 5, 1, 128, 64, 8, 5, True),
    FillCase("t19_kv4_d64_bs8_run", 19, 4, 64, 64, 8, 6, True, contiguous_run=True),
    FillCase("t300_kv8_d128_bs64", 300, 8, 128, 128, 64, 9, False),
    FillCase("t129_kv3_d80_bs16_run", 129, 3, 80, 80, 16, 13, False, contiguous_run=True, packed=False),
    # MLA (LMDeploy's DeepSeek): one latent head of kv_lora_rank + rope dims; the value is its first
    # kv_lora_rank dims and lands in the key cache's memory through a view.
    FillCase("t9_mla_d48_dv32_bs4_run", 9, 1, 48, 32, 4, 5, True, contiguous_run=True, latent=True),
    FillCase("t70_mla_d576_dv512_bs64", 70, 1, 576, 512, 64, 3, False, latent=True),
]

# (index dtype, kv_indices as [T, 1], id)
INDEX_VARIANTS = [
    (torch.int32, False, "int32"),
    (torch.int64, False, "int64"),
    (torch.int32, True, "int32_Tx1"),
    (torch.int64, True, "int64_Tx1"),
]


def slots_for(case, g):
    if case.contiguous_run:
        blocks = torch.randperm(case.nb, generator=g).tolist()
        start = 3  # a history that does not divide the block size
        return [blocks[p // case.bs] * case.bs + p % case.bs for p in range(start, start + case.T)]
    return torch.randperm(case.nb * case.bs, generator=g)[: case.T].tolist()


def _fill(vendor, layout, case, dtype, index_dtype, column):
    g = gen(seed_of("fill", case.id, dtype, layout))
    _, key, value = packed_qkv(case.T, 1, case.hkv, case.d, case.dv, dtype, g, case.packed)
    key_cache = alloc_cache(case.nb, case.bs, case.hkv, case.d, layout, dtype, g)
    value_cache = alloc_cache(case.nb, case.bs, case.hkv, case.dv, layout, dtype, g)
    if case.latent:
        value, value_cache = key[..., :case.dv], key_cache[..., :case.dv]
    slots = torch.tensor(slots_for(case, g), dtype=index_dtype, device=device())
    if column:
        slots = slots.reshape(-1, 1)
    exp_k, exp_v = ref.fill_kv_cache(key, value, key_cache, value_cache, slots, layout)
    k_ptr, v_ptr = key_cache.data_ptr(), value_cache.data_ptr()
    out_k, out_v = ops.fill_kv_cache(key, value, key_cache, value_cache, slots,
                                     k_scales_zeros=(), v_scales_zeros=(), quant_bits=0)
    expect(key_cache.data_ptr() == k_ptr and value_cache.data_ptr() == v_ptr, "fill_kv_cache replaced a cache tensor")
    assert_equal(key_cache, exp_k, "fill_kv_cache", name="key_cache (in place)")
    assert_equal(value_cache, exp_v, "fill_kv_cache", name="value_cache (in place)")
    assert_equal(out_k, exp_k, "fill_kv_cache", name="returned key_cache")
    assert_equal(out_v, exp_v, "fill_kv_cache", name="returned value_cache")


@suite("fill_kv_cache")
def fill_kv_cache(layouts):
    return [Check("fill_kv_cache", params(layout, c.id, dt, vid), "fill_kv_cache", PARITY,
                  partial(_fill, layout=layout, case=c, dtype=dt, index_dtype=idt, column=col), case=c.id, dtype=dt,
                  layout=layout, small=c.small)
            for layout in layouts for c in CASES for dt in DTYPES for idt, col, vid in INDEX_VARIANTS]


def _lmdeploy_call(vendor, layout):
    """The exact call of lmdeploy/pytorch/kernels/dlinfer/fill_kv_cache.py (keyword scales)."""
    g = gen(11)
    key = torch.randn(3, 2, 64, generator=g).to(device())
    value = torch.randn(3, 2, 64, generator=g).to(device())
    kc = alloc_cache(4, 16, 2, 64, layout, torch.float32, g)
    vc = alloc_cache(4, 16, 2, 64, layout, torch.float32, g)
    slots = torch.tensor([17, 18, 63], dtype=torch.int32, device=device())
    exp_k, exp_v = ref.fill_kv_cache(key, value, kc, vc, slots, layout)
    out_k, out_v = ops.fill_kv_cache(key, value, kc, vc, slots, k_scales_zeros=[], v_scales_zeros=[], quant_bits=0)
    assert_equal(kc, exp_k, "fill_kv_cache", name="key_cache")
    assert_equal(vc, exp_v, "fill_kv_cache", name="value_cache")
    # LMDeploy hands the returned caches to attention: they must be the caches, same layout.
    for name, out, cache in (("key", out_k, kc), ("value", out_v, vc)):
        expect(out.data_ptr() == cache.data_ptr() and out.shape == cache.shape and out.stride() == cache.stride(),
               f"fill_kv_cache: the returned {name} cache is not the {name}_cache argument")


@suite("fill_kv_cache_lmdeploy_call")
def fill_kv_cache_lmdeploy_call(layouts):
    return [Check("fill_kv_cache_lmdeploy_call", layout, "fill_kv_cache", PARITY,
                  partial(_lmdeploy_call, layout=layout), case="lmdeploy_call", layout=layout) for layout in layouts]
