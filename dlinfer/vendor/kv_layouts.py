"""The two paged KV-cache layouts, decided in this one place (docs/design.md, "KV-cache layouts").

A per-layer cache holds NB blocks of BS token slots, each slot Hkv heads of D elements:

  token_major: [NB, BS, Hkv, D]   (LMDeploy's default dlinfer block shape)
  head_major:  [NB, Hkv, BS, D]

Everything that needs to know which dimension is which asks this module: the op checks
(`dims`), the vendors (`canonical`, which every kernel reads through), and the LMDeploy adaptor
(`block_shape`, what it allocates). Kernels never branch on the layout: they receive the
`canonical` view, always indexed [block, slot, head, dim], and read its strides.
"""

from __future__ import annotations

from typing import Tuple, Union

from torch import Tensor

TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"
KV_LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)


def _known(layout: str) -> None:
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unknown dlinfer KV layout {layout!r}; known: {KV_LAYOUTS}")


def block_shape(layout: str, block_size: int, num_heads: int, head_dim: int) -> Tuple[int, int, int]:
    """The shape of one block of one layer's cache: (BS, Hkv, D) or (Hkv, BS, D)."""
    _known(layout)
    if layout == HEAD_MAJOR:
        return (num_heads, block_size, head_dim)
    return (block_size, num_heads, head_dim)


def dims(layout: str, num_heads: Union[int, str], head_dim: Union[int, str]) -> tuple:
    """The dims of a whole cache in `layout`, for argument checks: names ("NB", "BS") where any
    size goes, the given heads and head dim where they are fixed."""
    return ("NB",) + block_shape(layout, "BS", num_heads, head_dim)  # type: ignore[arg-type]


def canonical(cache: Tensor, layout: str) -> Tensor:
    """cache as a [NB, BS, Hkv, D] view of the same memory (no copy): itself for token_major, a
    permuted view for head_major. Writes through the view land in the cache."""
    return cache.transpose(1, 2) if layout == HEAD_MAJOR else cache


def blocks_and_size(cache: Tensor, layout: str) -> Tuple[int, int]:
    """(NB, BS) of a cache in `layout`."""
    return cache.shape[0], cache.shape[2] if layout == HEAD_MAJOR else cache.shape[1]
