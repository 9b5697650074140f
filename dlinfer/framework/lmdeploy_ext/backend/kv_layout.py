"""Per-layer KV-cache block shapes in the active dlinfer vendor's layout.

LMDeploy allocates each layer's cache as [NB, *block_shape] with the block shape its ops backend
returns; dlinfer's ops then read that cache in the layout the active vendor declares. Both come
from one place, `dlinfer/vendor/kv_layouts.py` (docs/design.md, "KV-cache layouts").
"""

from __future__ import annotations

import dlinfer.vendor
from dlinfer.vendor.kv_layouts import block_shape

__all__ = ["active_kv_layout", "block_shape"]


def active_kv_layout(torch_device: str) -> str:
    """The layout every dlinfer op expects for caches on `torch_device` ('cpu', 'cuda')."""
    return dlinfer.vendor.kv_layout(torch_device)
