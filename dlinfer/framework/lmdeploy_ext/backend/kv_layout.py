"""Per-layer KV-cache block shapes from the active dlinfer vendor's layout.

LMDeploy allocates each layer's cache as [NB, *block_shape] with the block shape its ops backend
returns. dlinfer vendors declare one of two layouts (`dlinfer.vendor.kv_layout`):
  token_major: block [BS, Hkv, D] -> cache [NB, BS, Hkv, D]  (LMDeploy's default dlinfer shape)
  head_major:  block [Hkv, BS, D] -> cache [NB, Hkv, BS, D]
"""

from __future__ import annotations

import dlinfer.vendor


def active_kv_layout(torch_device: str) -> str:
    """The layout every dlinfer op expects for caches on `torch_device` ('cpu', 'cuda')."""
    return dlinfer.vendor.kv_layout(torch_device)


def block_shape(layout: str, block_size: int, num_heads: int, head_size: int) -> tuple[int, int, int]:
    """The shape of one cache block of one layer for `layout`."""
    if layout == dlinfer.vendor.TOKEN_MAJOR:
        return (block_size, num_heads, head_size)
    if layout == dlinfer.vendor.HEAD_MAJOR:
        return (num_heads, block_size, head_size)
    raise ValueError(f"unknown dlinfer KV layout {layout!r}; known: {dlinfer.vendor.KV_LAYOUTS}")
