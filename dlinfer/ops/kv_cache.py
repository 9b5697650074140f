"""Writing new tokens' K/V into the paged KV cache."""

from __future__ import annotations

from typing import Sequence, Tuple

from torch import Tensor

from dlinfer.errors import InvalidArgumentError
from dlinfer.ops import _checks as C
from dlinfer.ops._dispatch import check_dtype, kernel_for, require
from dlinfer.vendor import kv_layouts
from dlinfer.vendor.base import FEATURE_KV_QUANT
from dlinfer.vendor.selection import kv_layout as active_kv_layout


def check_quant_bits(op: str, vendor, quant_bits) -> None:
    """quant_bits is 0/None (a cache in the activation dtype), 4 or 8; a quantised cache needs a
    vendor that declares it."""
    if quant_bits not in (0, None, 4, 8):
        raise InvalidArgumentError(op, "quant_bits", "0, 4 or 8", str(quant_bits))
    if quant_bits:
        require(vendor, op, FEATURE_KV_QUANT)


def cache_dims(op: str, name: str, cache, layout: str, heads: int, head_dim, device, dtype) -> Tuple[int, int]:
    """Check a per-layer cache tensor in `layout`; return (num_blocks, block_size)."""
    C.tensor(op, name, cache, kv_layouts.dims(layout, heads, head_dim), None, device)
    if cache.dtype != dtype:
        raise InvalidArgumentError(op, name, f"dtype {dtype} (unquantised cache)", C.describe(cache))
    return kv_layouts.blocks_and_size(cache, layout)


def fill_kv_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    kv_indices: Tensor,
    k_scales_zeros: Sequence = (),
    v_scales_zeros: Sequence = (),
    quant_bits: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Write each new token's key and value into its cache slot (slot = block_id * BS + offset).

    key: [T, Hkv, D]; value: [T, Hkv, Dv] (a leading batch dim of 1 is accepted).
    key_cache / value_cache: [NB, BS, Hkv, D] / [NB, BS, Hkv, Dv] ("token_major") or
        [NB, Hkv, BS, D] / [NB, Hkv, BS, Dv] ("head_major"), as the active vendor declares
        (`dlinfer.vendor.kv_layout()`, dlinfer/vendor/kv_layouts.py); same dtype as key.
        WRITTEN IN PLACE at the T slots.
    kv_indices: [T] or [T, 1] int32/int64 slots, on the device of key. Every slot must lie in
        [0, NB*BS) (checked under DLINFER_CHECK_VALUES=1; kernels never write outside the cache).
    k_scales_zeros, v_scales_zeros, quant_bits: the quantised cache (quant_bits 4 or 8), which no
        in-tree vendor implements: quant_bits != 0 raises UnsupportedError.
    Returns (key_cache, value_cache), the same tensors.
    """
    op = "fill_kv_cache"
    if isinstance(key, Tensor) and key.dim() == 4 and key.shape[0] == 1:
        key = key[0]
    if isinstance(value, Tensor) and value.dim() == 4 and value.shape[0] == 1:
        value = value[0]
    C.tensor(op, "key", key, ("T", "Hkv", "D"), C.FLOAT_DTYPES)
    t, hkv, d = key.shape
    C.tensor(op, "value", value, (t, hkv, "Dv"), C.FLOAT_DTYPES, key.device)
    C.same_dtype(op, "value", value, key, "key")
    if isinstance(kv_indices, Tensor) and kv_indices.dim() == 2 and kv_indices.shape[1] == 1:
        kv_indices = kv_indices.view(-1)
    C.tensor(op, "kv_indices", kv_indices, (t,), C.INDEX_DTYPES, key.device)
    kernel, vendor = kernel_for(op, key.device)
    check_quant_bits(op, vendor, quant_bits)
    check_dtype(vendor, op, key.dtype)
    layout = active_kv_layout(key.device.type)
    nb, bs = cache_dims(op, "key_cache", key_cache, layout, hkv, d, key.device, key.dtype)
    cache_dims(op, "value_cache", value_cache, layout, hkv, value.shape[2], key.device, key.dtype)
    if value_cache.shape[0] != nb:
        raise InvalidArgumentError(op, "value_cache", f"{nb} blocks like key_cache", C.describe(value_cache))
    if C.check_values_enabled() and t:
        lo, hi = int(kv_indices.min()), int(kv_indices.max())
        if lo < 0 or hi >= nb * bs:
            raise InvalidArgumentError(op, "kv_indices", f"slots in [0, {nb * bs})", f"slots in [{lo}, {hi}]")
    if t:
        kernel(key, value, key_cache, value_cache, kv_indices, layout)
    return key_cache, value_cache
