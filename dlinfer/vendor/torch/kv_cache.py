"""Paged KV-cache writes in PyTorch."""

import torch
from torch import Tensor

from dlinfer.vendor.base import HEAD_MAJOR


def fill_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, kv_indices: Tensor,
                  kv_layout: str) -> None:
    """Write key [T, Hkv, D] / value [T, Hkv, Dv] at slots kv_indices [T] of the caches (in place).

    Slots outside [0, NB*BS) are dropped, so bad metadata never writes outside the cache.
    """
    nb = key_cache.shape[0]
    bs = key_cache.shape[2] if kv_layout == HEAD_MAJOR else key_cache.shape[1]
    slots = kv_indices.long()
    valid = (slots >= 0) & (slots < nb * bs)
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks, offsets = slots // bs, slots % bs
    if kv_layout == HEAD_MAJOR:
        key_cache[blocks, :, offsets] = key
        value_cache[blocks, :, offsets] = value
    else:
        key_cache[blocks, offsets] = key
        value_cache[blocks, offsets] = value
