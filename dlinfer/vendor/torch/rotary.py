"""Rotate-half rotary embedding in PyTorch (fp32 math, partial rotary supported).

rotate_half(x) * sin == roll(x, R/2) * [-sin[:R/2], sin[R/2:]] exactly (a sign flip is exact), so
each tensor costs a roll, two multiplies and an add; the signed sin is built once per step (every
layer of a step passes the same cos/sin). The float32 result is bitwise HF's q * cos +
rotate_half(q) * sin.
"""

import torch
from torch import Tensor

from dlinfer.utils.memo import LastCallMemo


def _signed_sin(sin: Tensor) -> Tensor:
    """sin [T, R] -> float32 [T, 1, R] with the first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).float().unsqueeze(1)


_signed_sin_memo = LastCallMemo(_signed_sin)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    rot = cos.shape[-1]
    xr = x[..., :rot].float()
    out = xr * cos
    out += torch.roll(xr, rot // 2, dims=-1) * signed_sin
    if rot == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor):
    """query [T, Hq, D], key [T, Hkv, D], cos/sin [T, R] -> new (q, k)."""
    c = cos.float().unsqueeze(1)  # [T, 1, R]
    s = _signed_sin_memo(sin)
    return _rotate(query, c, s), _rotate(key, c, s)


def apply_rotary_pos_emb_interleaved(x: Tensor, cos: Tensor, sin: Tensor, return_native_layout: bool) -> Tensor:
    """x [T, H, D] adjacent pairs, cos / sin [T, D] half layout -> new [T, H, D] in x's dtype:
    a = x[..., 0::2], b = x[..., 1::2]; a' = a c - b s, b' = b c + a s (fp32); the output
    cat(a', b') (return_native_layout) or a', b' interleaved back."""
    half = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()
    a2, b2 = a * c - b * s, b * c + a * s
    if return_native_layout:
        return torch.cat((a2, b2), dim=-1).to(x.dtype)
    return torch.stack((a2, b2), dim=-1).flatten(-2).to(x.dtype)
