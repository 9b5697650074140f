"""KV/state-cache allocation on the host for the "cpu" device type.

LMDeploy's cache engine asks every layout to allocate on device "cuda"
(cache_engine/engine.py:122, cache_engine/state.py:36) and to size itself on "meta". The cache
backend is an ops-backend hook (`get_cache_backend`), so the CPU backend returns layouts that
allocate on its own torch device instead of "cuda"; LMDeploy itself is not patched for this.

The KV cache (LMDeploy 0.18's `ContiguousBlockCacheLayout`: one zeroed tensor per K and V, all
layers) is allocated here on 2 MB pages (`dlinfer.utils.hugepages`): decode attention reads
cached rows scattered over the whole cache, and with 4 KB pages a long context spends much of
its time on TLB misses (paged decode attention over 67 MB of K/V on 2 cores: ~15 GB/s on 4 KB
pages, ~23 GB/s on 2 MB pages). Start-up pays about 1.6 s per GB of cache for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dlinfer.utils.hugepages import empty_on_huge_pages
from lmdeploy.pytorch.backends.dlinfer.cache import DlinferCacheBackend
from lmdeploy.pytorch.engine.cache_engine.layout import CacheAllocation, CachePool, ContiguousBlockCacheLayout


def _contiguous_on_huge_pages(layout: ContiguousBlockCacheLayout, num_blocks: int) -> CacheAllocation:
    """What `ContiguousBlockCacheLayout.allocate(num_blocks, "cpu")` returns (LMDeploy 0.18.0,
    engine/cache_engine/layout.py:112), each tensor on 2 MB pages."""
    pools, views = [], []
    for spec in layout.tensor_specs:
        rows = len(spec.consumer_rows) if spec.consumer_rows is not None else layout.num_layers
        cache = empty_on_huge_pages((rows, num_blocks, *spec.desc.shape), spec.desc.dtype).zero_()
        pools.append(CachePool(cache, entry_axis=1))
        views.append(cache)
    return CacheAllocation(pools=tuple(pools), tensor_views=tuple(views))


@dataclass(frozen=True)
class PlacedLayout:
    """A cache layout whose "cuda" allocations land on `device`; "meta"/"cpu" ones stay put."""

    layout: Any
    device: str

    def _place(self, device: torch.device | str) -> torch.device | str:
        return self.device if torch.device(device).type == "cuda" else device

    def allocate(self, *args, device: torch.device | str, **kwargs):
        device = self._place(device)
        if (torch.device(device).type == "cpu" and type(self.layout) is ContiguousBlockCacheLayout
                and self.layout.tensor_specs):
            return _contiguous_on_huge_pages(self.layout, *args, **kwargs)
        return self.layout.allocate(*args, device=device, **kwargs)


class HostCacheBackend(DlinferCacheBackend):
    """LMDeploy's dlinfer cache layouts (one contiguous tensor per K and V), allocated on the host."""

    torch_device: ClassVar[str] = "cpu"

    @classmethod
    def build_block_layout(cls, tensor_specs, num_layers: int):
        return PlacedLayout(super().build_block_layout(tensor_specs, num_layers), cls.torch_device)

    @classmethod
    def build_state_layout(cls, tensor_specs):
        return PlacedLayout(super().build_state_layout(tensor_specs), cls.torch_device)
