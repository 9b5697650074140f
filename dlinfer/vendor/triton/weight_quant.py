"""W4A16 (`weight_quant_matmul`) in Triton: the 4-bit weight unpacked in the kernel.

One program computes a [BLOCK_M, BLOCK_N] tile of y = x @ W, walking K in BLOCK_K steps: it loads
the tile's int32 words (each word serves 8 columns; canonical AWQ layout or column_tiled, by
address and shift arithmetic, never a copy), the zero-point words and the scales of each row's group,
upcasts everything to fp32 right after the load, forms W = float(q - z) * s (exact for half-type
scales) and accumulates x @ W with an IEEE fp32 tl.dot (no TF32). Bias in fp32, one rounding to
x's dtype. Column c of word j = c // 8 sits at bits 4i..4i+3 with i = (c % 8) // 2 + 4 * (c % 2),
the inverse of AWQ's order [0, 2, 4, 6, 1, 3, 5, 7] (the zero points always; the weight in the canonical
layout; column_tiled: bits 4 * ((c % 128) // 16) of word c % 16 of tile c // 128).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor import w4_layouts
from dlinfer.vendor.triton._common import cast_to, unit_stride


@triton.jit
def _w4_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, G, stride_xm,
               HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, TILED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    words = N // 8
    j = rn // 8  # the column's word
    r = rn % 8
    shift = 4 * ((r // 2) + 4 * (r % 2))  # its nibble
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        if TILED:  # [ceil(N/128), K, 16]: column c at word c % 16 of tile c // 128, bits 4 * ((c % 128) // 16)
            q_off = (rn // 128)[None, :] * (K * 16) + rk[:, None] * 16 + (rn % 16)[None, :]
            q_shift = 4 * ((rn % 128) // 16)
        else:  # [K, N/8]
            q_off = rk[:, None] * words + j[None, :]
            q_shift = shift
        wk_ok = k_ok[:, None] & n_ok[None, :]
        qw = tl.load(q_ptr + q_off, mask=wk_ok, other=0)
        q = (qw >> q_shift[None, :]) & 15
        gi = rk // G
        s = tl.load(s_ptr + gi[:, None] * N + rn[None, :], mask=wk_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zw = tl.load(z_ptr + gi[:, None] * words + j[None, :], mask=wk_ok, other=0)
            z = (zw >> shift[None, :]) & 15
        else:
            z = 8
        w = (q - z).to(tl.float32) * s
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], cast_to(acc, y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def weight_quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
                        group_size: int) -> Tensor:
    """x [M, K], qweight int32 [K, N/8] or column_tiled [ceil(N/128), K, 16] (k_interleaved: made
    canonical first), scale [K/g, N] (x's dtype or float16), offset int32 [K/g, N/8]?, bias [N]?,
    group_size g -> [M, N] in x's dtype."""
    m, k = x.shape
    n = scale.shape[1]
    x = unit_stride(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if w4_layouts.is_k_interleaved(qweight):  # another vendor's load-time layout: read as canonical
        qweight = w4_layouts.canonical(qweight, n)
    qweight, scale = qweight.contiguous(), scale.contiguous()
    offset = None if offset is None else offset.contiguous()
    block_m = 16 if m <= 16 else 32
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4_kernel[grid](x, qweight, scale, offset if offset is not None else qweight, bias if bias is not None else scale,
                     y, m, n, k, group_size, x.stride(0), HAS_ZEROS=offset is not None, HAS_BIAS=bias is not None,
                     TILED=w4_layouts.is_column_tiled(qweight), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
