"""The int8 KV cache (`quant_bits=8`): argument checks and the canonical per-head scales.

Contract (docs/ops.md, "The int8 KV cache"): an int8 cache stores, per element of head h,
    q = clamp(round_half_even(x_f32 / scale[h] + zero[h]), -128, 127)
(float32 division, then float32 addition, then rounding), and attention reads it back as
    (q - zero[h]) * scale[h].
Scales and zeros are static (per layer) and either one value for every KV head or one per head,
as LMDeploy's dlinfer layers pass them (`attn_metadata.quant_meta`):
    fill_kv_cache: k_scales_zeros = [k_scale, k_zero], v_scales_zeros = [v_scale, v_zero],
        each [1] or [Hkv] (a zero may be None: 0);
    paged attention: kv_scales = [k_scale, v_scale] as [2] or [2, Hkv]; kv_zeros alike or None.
Any float dtype on the query's device (Ascend passes the model dtype). Canonically they become
four float32 tensors [Hkv] on the device (`KVQuant`); all four are None for an unquantised cache.

The cache of a quantised call is int8, or uint8 (what LMDeploy 0.18's cache engine allocates for
quant_policy=8, `_resolve_kv_cache_dtype`): its bytes are the same two's-complement int8 values,
and the op hands the vendor an int8 view of it (`int8_view`). quant_bits=4 (LMDeploy's int4
cache: two 4-bit values per byte with per-token scales in separate caches, a different scheme) is
refused by name.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from dlinfer.errors import InvalidArgumentError, UnsupportedError
from dlinfer.ops import _checks as C
from dlinfer.ops._dispatch import require
from dlinfer.vendor.base import FEATURE_KV_QUANT

QUANT_CACHE_DTYPES = (torch.int8, torch.uint8)


class KVQuant(NamedTuple):
    """Canonical quantisation arguments: float32 [Hkv] each, on the query's device, or all None."""

    k_scale: Optional[Tensor] = None
    k_zero: Optional[Tensor] = None
    v_scale: Optional[Tensor] = None
    v_zero: Optional[Tensor] = None


NO_QUANT = KVQuant()


def check_quant_bits(op: str, vendor, quant_bits) -> int:
    """0 (None too) for a cache in the activation dtype, 8 for the int8 cache; 4 is refused
    (UnsupportedError), anything else is an InvalidArgumentError."""
    if quant_bits is None or (isinstance(quant_bits, int) and not isinstance(quant_bits, bool) and quant_bits == 0):
        return 0
    if isinstance(quant_bits, bool) or not isinstance(quant_bits, int) or quant_bits not in (4, 8):
        raise InvalidArgumentError(op, "quant_bits", "0, 4 or 8", C.describe(quant_bits))
    if quant_bits == 4:
        raise UnsupportedError(vendor.name, op, "quant_bits=4 (the int4 KV cache; only quant_bits=8 is implemented)")
    require(vendor, op, FEATURE_KV_QUANT)
    return 8


def cache_dtypes(quant_bits: int, dtype: torch.dtype) -> tuple:
    return QUANT_CACHE_DTYPES if quant_bits else (dtype,)


def int8_view(cache: Tensor) -> Tensor:
    """The cache as int8 (a uint8 cache reinterpreted, same memory, same strides)."""
    return cache.view(torch.int8) if cache.dtype == torch.uint8 else cache


def _per_head(op: str, name: str, t, hkv: int, device: torch.device, zero: bool) -> Tensor:
    if t is None and zero:
        return torch.zeros(hkv, dtype=torch.float32, device=device)
    C.tensor(op, name, t, ("1 or Hkv",), C.FLOAT_DTYPES, device)
    if t.shape[0] not in (1, hkv):
        raise InvalidArgumentError(op, name, f"shape [1] or [Hkv={hkv}]", C.describe(t))
    return t.to(torch.float32).expand(hkv).contiguous()


def _check_values(op: str, names: Sequence[str], q: KVQuant) -> None:
    if not C.check_values_enabled():
        return
    for name, scale in ((names[0], q.k_scale), (names[1], q.v_scale)):
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise InvalidArgumentError(op, name, "finite scales > 0", str(scale.tolist()))
    for name, zero in ((names[2], q.k_zero), (names[3], q.v_zero)):
        if not bool(torch.isfinite(zero).all()):
            raise InvalidArgumentError(op, name, "finite zeros", str(zero.tolist()))


def _pair(op: str, name: str, pair) -> tuple:
    if isinstance(pair, Tensor) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise InvalidArgumentError(op, name, "a sequence [scale, zero] (quant_bits=8)", C.describe(pair))
    return pair[0], pair[1]


def fill_args(op: str, quant_bits: int, k_scales_zeros, v_scales_zeros, hkv: int, device) -> KVQuant:
    """fill_kv_cache's [scale, zero] pairs -> KVQuant (NO_QUANT when quant_bits is 0, where the
    pairs must be empty)."""
    if not quant_bits:
        for name, pair in (("k_scales_zeros", k_scales_zeros), ("v_scales_zeros", v_scales_zeros)):
            if pair is not None and (isinstance(pair, Tensor) or len(pair)):
                raise InvalidArgumentError(op, name, "empty (quant_bits=0)", C.describe(pair))
        return NO_QUANT
    ks, kz = _pair(op, "k_scales_zeros", k_scales_zeros)
    vs, vz = _pair(op, "v_scales_zeros", v_scales_zeros)
    q = KVQuant(_per_head(op, "k_scales_zeros[0]", ks, hkv, device, False),
                _per_head(op, "k_scales_zeros[1]", kz, hkv, device, True),
                _per_head(op, "v_scales_zeros[0]", vs, hkv, device, False),
                _per_head(op, "v_scales_zeros[1]", vz, hkv, device, True))
    _check_values(op, ("k_scales_zeros[0]", "v_scales_zeros[0]", "k_scales_zeros[1]", "v_scales_zeros[1]"), q)
    return q


def _kv_pair(op: str, name: str, t, hkv: int, device, zero: bool):
    if t is None and zero:
        z = torch.zeros(hkv, dtype=torch.float32, device=device)
        return z, z
    if not isinstance(t, Tensor) or t.dim() not in (1, 2):
        raise InvalidArgumentError(op, name, f"a tensor [2] or [2, Hkv={hkv}]", C.describe(t))
    C.tensor(op, name, t, (2,) if t.dim() == 1 else (2, "Hkv"), C.FLOAT_DTYPES, device)
    if t.dim() == 2 and t.shape[1] not in (1, hkv):
        raise InvalidArgumentError(op, name, f"shape [2] or [2, Hkv={hkv}]", C.describe(t))
    t = t.to(torch.float32).reshape(2, -1).expand(2, hkv)
    return t[0].contiguous(), t[1].contiguous()


def attention_args(op: str, quant_bits: int, kv_scales, kv_zeros, hkv: int, device) -> KVQuant:
    """Paged attention's kv_scales / kv_zeros (K then V) -> KVQuant (NO_QUANT when quant_bits is
    0, where both must be None)."""
    if not quant_bits:
        for name, t in (("kv_scales", kv_scales), ("kv_zeros", kv_zeros)):
            if t is not None:
                raise InvalidArgumentError(op, name, "None (quant_bits=0)", C.describe(t))
        return NO_QUANT
    if kv_scales is None:
        raise InvalidArgumentError(op, "kv_scales", "[2] or [2, Hkv] (quant_bits=8)", "None")
    ks, vs = _kv_pair(op, "kv_scales", kv_scales, hkv, device, False)
    kz, vz = _kv_pair(op, "kv_zeros", kv_zeros, hkv, device, True)
    q = KVQuant(ks, kz, vs, vz)
    _check_values(op, ("kv_scales[0]", "kv_scales[1]", "kv_zeros[0]", "kv_zeros[1]"), q)
    return q
