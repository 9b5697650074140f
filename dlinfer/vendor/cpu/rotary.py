"""apply_rotary_pos_emb through the C++ kernel (csrc/rotary.cpp)."""

import torch
from torch import Tensor

_rotary = torch.ops.dlinfer_cpu.apply_rotary_pos_emb.default


def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor):
    """query [T, Hq, D], key [T, Hkv, D], cos/sin [T, R] -> new (q, k)."""
    return _rotary(query, key, cos.float().contiguous(), sin.float().contiguous())
