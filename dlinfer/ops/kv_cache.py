"""Writing new tokens' K/V into the paged KV cache."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

from dlinfer.errors import InvalidArgumentError
from dlinfer.ops import _checks as C
from dlinfer.ops import kv_quant
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, kernel_for
from dlinfer.vendor import kv_layouts
from dlinfer.vendor.selection import kv_layout as active_kv_layout


def cache_dims(op: str, name: str, cache, layout: str, heads: int, head_dim, device, dtypes: tuple) -> Tuple[int, int]:
    """Check a per-layer cache tensor in `layout` whose dtype is one of `dtypes`; return
    (num_blocks, block_size)."""
    C.tensor(op, name, cache, kv_layouts.dims(layout, heads, head_dim), None, device)
    if cache.dtype not in dtypes:
        kind = "int8 cache, quant_bits=8" if torch.int8 in dtypes else "unquantised cache, quant_bits=0"
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise InvalidArgumentError(op, name, f"dtype {names} ({kind})", C.describe(cache))
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
        (`dlinfer.vendor.kv_layout()`, dlinfer/vendor/kv_layouts.py); same dtype as key, or int8
        (uint8 accepted, read as int8) when quant_bits=8. WRITTEN IN PLACE at the T slots.
    kv_indices: [T] or [T, 1] int32/int64 slots, on the device of key. Every slot must lie in
        [0, NB*BS) (checked under DLINFER_CHECK_VALUES=1; kernels never write outside the cache).
    quant_bits: 0 (or None): caches in key's dtype; 8: int8 caches storing
        clamp(round_half_even(x / scale + zero), -128, 127) per KV head (dlinfer/ops/kv_quant.py);
        4: UnsupportedError.
    k_scales_zeros, v_scales_zeros: [scale, zero] for K and V, each [1] or [Hkv] float (zero may be
        None), on key's device, when quant_bits=8; empty otherwise.
    Returns (key_cache, value_cache), the same tensors.
    """
    op = "fill_kv_cache"
    args = (key, value, key_cache, value_cache, kv_indices, quant_bits)
    kernel = (_check_fill_kv_cache(*args) if not torch.compiler.is_compiling()
              else checked(op, _check_fill_kv_cache, *args))
    key, value = token_rows(key), token_rows(value)
    if kv_indices.dim() == 2:  # [T, 1] (checked)
        kv_indices = kv_indices.view(-1)
    t, hkv = key.shape[0], key.shape[1]
    bits = 8 if quant_bits else 0
    layout = active_kv_layout(key.device.type)
    quant = kv_quant.fill_args(op, bits, k_scales_zeros, v_scales_zeros, hkv, key.device)
    if C.check_values_enabled() and t:
        nb, bs = kv_layouts.blocks_and_size(key_cache, layout)
        lo, hi = int(kv_indices.min()), int(kv_indices.max())
        if lo < 0 or hi >= nb * bs:
            raise InvalidArgumentError(op, "kv_indices", f"slots in [0, {nb * bs})", f"slots in [{lo}, {hi}]")
    if t:
        kernel(key, value, kv_quant.int8_view(key_cache), kv_quant.int8_view(value_cache), kv_indices, layout, *quant)
    return key_cache, value_cache


def token_rows(t: Tensor) -> Tensor:
    """[1, T, H, D] as [T, H, D] (itself otherwise, a non-tensor too: the checks refuse it)."""
    return t[0] if isinstance(t, Tensor) and t.dim() == 4 and t.shape[0] == 1 else t


def _check_fill_kv_cache(key, value, key_cache, value_cache, kv_indices, quant_bits):
    """Checks fill_kv_cache's tensors and quant_bits (the scale pairs: `kv_quant.fill_args`);
    returns the vendor's function (`kernel_for`)."""
    op = "fill_kv_cache"
    key, value = token_rows(key), token_rows(value)
    C.tensor(op, "key", key, ("T", "Hkv", "D"), C.FLOAT_DTYPES)
    t, hkv, d = key.shape
    C.tensor(op, "value", value, (t, hkv, "Dv"), C.FLOAT_DTYPES, key.device)
    C.same_dtype(op, "value", value, key, "key")
    if isinstance(kv_indices, Tensor) and kv_indices.dim() == 2 and kv_indices.shape[1] == 1:
        kv_indices = kv_indices.view(-1)
    C.tensor(op, "kv_indices", kv_indices, (t,), C.INDEX_DTYPES, key.device)
    kernel, vendor = kernel_for(op, key.device)
    bits = kv_quant.check_quant_bits(op, vendor, quant_bits)
    check_dtype(vendor, op, key.dtype)
    layout = active_kv_layout(key.device.type)
    dtypes = kv_quant.cache_dtypes(bits, key.dtype)
    nb, _ = cache_dims(op, "key_cache", key_cache, layout, hkv, d, key.device, dtypes)
    cache_dims(op, "value_cache", value_cache, layout, hkv, value.shape[2], key.device, dtypes)
    if value_cache.shape[0] != nb:
        raise InvalidArgumentError(op, "value_cache", f"{nb} blocks like key_cache", C.describe(value_cache))
    return kernel
