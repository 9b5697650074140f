"""Paged KV-cache write for both layouts.

Algorithm: program (token t, head block). slot = kv_indices[t] as int64; block = slot // BS,
offset = slot % BS; the K row [heads, D] and V row [heads, Dv] are bit-copied to
cache[block, offset, head] (token_major) or cache[block, head, offset] (head_major). The layout
only changes which cache strides the launcher passes (those of `kv_layouts.canonical`). All cache offsets are
int64 (caches past
2**31 elements). A slot outside [0, NB*BS) is masked: nothing is written for that token, and no
host sync is needed to find out.

The int8 cache (QUANT): each element becomes clamp(round_half_even(x / scale[h] + zero[h]),
-128, 127) in registers: an IEEE float32 division (`div_rn`, not the approximate `/` of GPUs),
a float32 addition, rounding spelled out with floor (ties to even), as dlinfer/ops/kv_quant.py
specifies. Scales and zeros arrive as one float32 [4, Hkv] tensor (k_scale, k_zero, v_scale,
v_zero).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor.kv_layouts import canonical
from dlinfer.vendor.triton._common import next_pow2


@triton.jit
def _quantise(x, scale, zero):
    """x [H, D] -> int8 clamp(round_half_even(x / scale[:, None] + zero[:, None]), -128, 127)."""
    y = tl.math.div_rn(x.to(tl.float32), scale[:, None]) + zero[:, None]
    r = tl.floor(y)
    frac = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    r = tl.where(y == y, r, 0.0)  # NaN -> 0
    return tl.minimum(tl.maximum(r, -128.0), 127.0).to(tl.int8)


@triton.jit
def _fill_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, idx_ptr, q_ptr, stride_idx, n_slots, BS, Hkv, D, Dv,
                    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                    kc_sb, kc_ss, kc_sh, kc_sd, vc_sb, vc_ss, vc_sh, vc_sd,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + t * stride_idx).to(tl.int64)
    valid = (slot >= 0) & (slot < n_slots)
    slot = tl.where(valid, slot, 0)
    block = slot // BS
    offset = slot % BS
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = (heads < Hkv) & valid
    heads = heads.to(tl.int64)

    d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d < D)[None, :]
    key = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    if QUANT:
        key = _quantise(key, tl.load(q_ptr + heads, mask=hmask, other=1.0),
                        tl.load(q_ptr + Hkv + heads, mask=hmask, other=0.0))
    kc = kc_ptr + block * kc_sb + offset * kc_ss + heads[:, None] * kc_sh + d[None, :] * kc_sd
    tl.store(kc, key, mask=mask)

    dv = tl.arange(0, BLOCK_DV)
    mask = hmask[:, None] & (dv < Dv)[None, :]
    val = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dv[None, :] * stride_vd, mask=mask)
    if QUANT:
        val = _quantise(val, tl.load(q_ptr + 2 * Hkv + heads, mask=hmask, other=1.0),
                        tl.load(q_ptr + 3 * Hkv + heads, mask=hmask, other=0.0))
    vc = vc_ptr + block * vc_sb + offset * vc_ss + heads[:, None] * vc_sh + dv[None, :] * vc_sd
    tl.store(vc, val, mask=mask)


def fill_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, kv_indices: Tensor,
                  kv_layout: str, k_scale: Optional[Tensor] = None, k_zero: Optional[Tensor] = None,
                  v_scale: Optional[Tensor] = None, v_zero: Optional[Tensor] = None) -> None:
    """Write key [T, Hkv, D] / value [T, Hkv, Dv] at slots kv_indices [T] of the caches (in place);
    quantised into int8 caches when k_scale etc. ([Hkv] float32) are given."""
    t, hkv, d = key.shape
    dv = value.shape[2]
    if t == 0:
        return
    key_cache, value_cache = canonical(key_cache, kv_layout), canonical(value_cache, kv_layout)  # [NB, BS, Hkv, D]
    nb, bs = key_cache.shape[:2]
    block_d, block_dv = next_pow2(d), next_pow2(dv)
    block_h = min(next_pow2(hkv), max(1, 4096 // max(block_d, block_dv)))
    quant = k_scale is not None
    packed = torch.stack([k_scale, k_zero, v_scale, v_zero]) if quant else kv_indices  # [4, Hkv] float32
    _fill_kv_kernel[(t, triton.cdiv(hkv, block_h))](
        key, value, key_cache, value_cache, kv_indices, packed, kv_indices.stride(0), nb * bs, bs, hkv, d, dv,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv, QUANT=quant, num_warps=4,
    )
