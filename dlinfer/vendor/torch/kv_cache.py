"""Paged KV-cache writes in PyTorch."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from dlinfer.utils.memo import LastCallMemo
from dlinfer.vendor.kv_layouts import canonical


def _slot_plan(kv_indices: Tensor, num_slots: int) -> Tuple[Tensor, Optional[Tensor]]:
    """(int64 slots to write, the rows kept or None when all are): slots outside
    [0, num_slots) are dropped. Built once per step (every layer writes the same slots)."""
    slots = kv_indices.to(torch.int64, copy=True)  # memoised: must not alias the caller's tensor
    valid = (slots >= 0) & (slots < num_slots)
    if bool(valid.all()):
        return slots, None
    keep = valid.nonzero().squeeze(1)
    return slots[keep], keep


_slot_plan_memo = LastCallMemo(_slot_plan)


def quantise(x: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """x [T, Hkv, D] float, scale / zero [Hkv] float32 -> int8 [T, Hkv, D]:
    clamp(round_half_even(x_f32 / scale + zero), -128, 127), float32 division then addition."""
    q = torch.round(x.float() / scale[:, None] + zero[:, None])
    return q.nan_to_num_(0.0).clamp_(-128, 127).to(torch.int8)


def fill_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, kv_indices: Tensor,
                  kv_layout: str, k_scale: Optional[Tensor] = None, k_zero: Optional[Tensor] = None,
                  v_scale: Optional[Tensor] = None, v_zero: Optional[Tensor] = None) -> None:
    """Write key [T, Hkv, D] / value [T, Hkv, Dv] at slots kv_indices [T] of the caches (in place).

    Slots outside [0, NB*BS) are dropped, so bad metadata never writes outside the cache. A
    contiguous token-major cache is one row per slot: one index_copy_ per cache. With k_scale
    etc. ([Hkv] float32) the caches are int8 and get `quantise`d rows.
    """
    if k_scale is not None:
        key, value = quantise(key, k_scale, k_zero), quantise(value, v_scale, v_zero)
    key_cache, value_cache = canonical(key_cache, kv_layout), canonical(value_cache, kv_layout)
    nb, bs = key_cache.shape[:2]  # [NB, BS, Hkv, D] views, written through
    slots, keep = _slot_plan_memo(kv_indices, nb * bs)
    if keep is not None:
        key, value = key[keep], value[keep]
    for src, cache in ((key, key_cache), (value, value_cache)):
        if cache.is_contiguous():
            cache.view(nb * bs, -1).index_copy_(0, slots, src.reshape(src.shape[0], -1))
        else:
            cache[slots // bs, slots % bs] = src
