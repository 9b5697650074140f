"""fill_kv_cache through the C++ kernel (csrc/kv_cache.cpp)."""

import torch
from torch import Tensor

from dlinfer.vendor.base import HEAD_MAJOR

_fill = torch.ops.dlinfer_cpu.fill_kv_cache.default


def fill_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, kv_indices: Tensor,
                  kv_layout: str) -> None:
    """Write key [T, Hkv, D] / value [T, Hkv, Dv] at slots kv_indices [T] (in place); slots outside
    [0, NB*BS) are skipped."""
    _fill(key, value, key_cache, value_cache, kv_indices.contiguous(), kv_layout == HEAD_MAJOR)
