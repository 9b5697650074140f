"""W4A16 (`weight_quant_matmul`) in PyTorch: the reference every vendor falls back to.

The weight is dequantised into float32, `W[k, c] = (q[k, c] - z[k // g, c]) * s[k // g, c]`
(exact for bfloat16/float16 scales: a 4-bit integer times an 8- or 11-bit significand; one
rounding for float32 scales), in column tiles of at most `_TILE_BYTES` so that a large N never
holds the whole float weight, and `x @ W` runs in float32 (BLAS), bias added in float32, one
rounding to x's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dlinfer.vendor import w4_layouts

_TILE_BYTES = 16 << 20  # float32 bytes of dequantised weight per GEMM


def dequantise(qweight: Tensor, scale: Tensor, offset: Optional[Tensor], group_size: int, c0: int = 0,
               c1: Optional[int] = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Columns c0:c1 (multiples of 8) of the weight [K, c1 - c0] in `dtype` from a canonical qweight
    int32 [K, N/8], scale [K/g, N], offset int32 [K/g, N/8] or None (zero point 8)."""
    c1 = scale.shape[1] if c1 is None else c1
    q = w4_layouts.unpack(qweight[:, c0 // 8:c1 // 8])
    z = 8 if offset is None else w4_layouts.unpack(offset[:, c0 // 8:c1 // 8]).repeat_interleave(group_size, 0)
    s = scale[:, c0:c1].to(dtype).repeat_interleave(group_size, 0)
    return (q - z).to(dtype) * s


def weight_quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
                        group_size: int) -> Tensor:
    """x [M, K], qweight int32 [K, N/8] (or a repacked layout of w4_layouts.py), scale [K/g, N],
    offset int32 [K/g, N/8]?, bias [N]?, group_size g (K % g == 0) -> [M, N] in x's dtype."""
    n = scale.shape[1]
    k = x.shape[1]
    qweight = w4_layouts.canonical(qweight, n)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # float64: the op tools' reference
    xf = x.to(acc)
    out = torch.empty((x.shape[0], n), dtype=acc, device=x.device)
    step = max(8, (_TILE_BYTES // (4 * max(k, 1))) // 8 * 8)
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        out[:, c0:c1] = xf @ dequantise(qweight, scale, offset, group_size, c0, c1, acc)
    if bias is not None:
        out += bias.to(acc)
    return out.to(x.dtype)
