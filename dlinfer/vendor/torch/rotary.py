"""Rotate-half rotary embedding in PyTorch (fp32 math, partial rotary supported)."""

import torch
from torch import Tensor


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rot = cos.shape[-1]
    half = rot // 2
    xr = x[..., :rot].float()
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # [T, 1, R]
    out = xr * c + torch.cat((-xr[..., half:], xr[..., :half]), dim=-1) * s
    if rot == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor):
    """query [T, Hq, D], key [T, Hkv, D], cos/sin [T, R] -> new (q, k)."""
    return _rotate(query, cos, sin), _rotate(key, cos, sin)
