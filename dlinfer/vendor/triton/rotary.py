"""Rotate-half rotary embedding for q and k in one launch (partial rotary: dims R..D copied).

Algorithm: program (token t, head block j). Blocks j < ceil(Hq / BLOCK_H) rotate query heads,
the rest key heads, so one launch covers both. With c/s = cos/sin[t] in fp32 and half = R/2:
  out[:half]  = x[:half] * c[:half] - x[half:R] * s[:half]
  out[half:R] = x[half:R] * c[half:R] + x[:half] * s[half:R]
  out[R:D]    = x[R:D]  (bit copy)
Outputs are new contiguous tensors. A tile holds up to 4K elements (BLOCK_HQ query heads, or
BLOCK_HK key heads, times the rotated dims).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor.triton._common import cast_to, next_pow2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, c1, s1, c2, s2, t, head0, n_heads, stride_xt, stride_xh, stride_xd,
                  stride_ot, stride_oh, HALF, R, D,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    heads = head0 + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & (j < HALF)[None, :]
    x_row = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    o_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(x_row + j[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (j[None, :] + HALF) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row + j[None, :], cast_to(x1 * c1[None, :] - x2 * s1[None, :], dtype), mask=mask)
    tl.store(o_row + HALF + j[None, :], cast_to(x2 * c2[None, :] + x1 * s2[None, :], dtype), mask=mask)
    if BLOCK_REST > 0:
        d = R + tl.arange(0, BLOCK_REST)
        rest_mask = (heads < n_heads)[:, None] & (d < D)[None, :]
        rest = tl.load(x_row + d[None, :] * stride_xd, mask=rest_mask)
        tl.store(o_row + d[None, :], rest, mask=rest_mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, Hq, Hkv, HALF, R, D,
                   stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct, stride_cr, stride_st, stride_sr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_REST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + j * stride_cr, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + (j + HALF) * stride_cr, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + j * stride_sr, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + (j + HALF) * stride_sr, mask=jm, other=0.0).to(tl.float32)
    q_blocks = tl.cdiv(Hq, BLOCK_HQ)
    if hb < q_blocks:
        _rotate_heads(q_ptr, qo_ptr, c1, s1, c2, s2, t, hb * BLOCK_HQ, Hq, stride_qt, stride_qh, stride_qd,
                      stride_qot, stride_qoh, HALF, R, D, BLOCK_HQ, BLOCK_HALF, BLOCK_REST)
    else:
        _rotate_heads(k_ptr, ko_ptr, c1, s1, c2, s2, t, (hb - q_blocks) * BLOCK_HK, Hkv, stride_kt, stride_kh,
                      stride_kd, stride_kot, stride_koh, HALF, R, D, BLOCK_HK, BLOCK_HALF, BLOCK_REST)


def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor):
    """query [T, Hq, D], key [T, Hkv, D], cos/sin [T, R] -> new (q, k)."""
    t, hq, d = query.shape
    hkv = key.shape[1]
    rot = cos.shape[-1]
    q_out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)
    k_out = torch.empty((t, hkv, d), dtype=key.dtype, device=key.device)
    if t == 0:
        return q_out, k_out
    half = rot // 2
    block_half = next_pow2(half)
    block_rest = next_pow2(d - rot) if d > rot else 0
    # Up to 4K elements a tile, the query's and the key's heads each in tiles of their own height
    # (all 32 query heads of a Llama in one program, its 8 key heads in another).
    cap = max(1, 4096 // (2 * block_half))
    block_hq, block_hk = min(next_pow2(hq), cap), min(next_pow2(hkv), cap)
    grid = (t, triton.cdiv(hq, block_hq) + triton.cdiv(hkv, block_hk))
    _rotary_kernel[grid](
        query, key, q_out, k_out, cos, sin, hq, hkv, half, rot, d,
        *query.stride(), *key.stride(), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        *cos.stride(), *sin.stride(),
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        num_warps=8 if block_hq * block_half >= 2048 else 4,
    )
    return q_out, k_out
