"""KV/state-cache allocation on the host for the "cpu" device type.

LMDeploy's cache engine asks every layout to allocate on device "cuda"
(`CacheEngine.allocate_gpu_cache` in cache_engine/engine.py, `StateCacheEngine.__init__` in
cache_engine/state.py) and to size itself on "meta". The cache
backend is an ops-backend hook (`get_cache_backend`), so the CPU backend returns layouts that
allocate on its own torch device instead of "cuda"; LMDeploy itself is not patched for this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from lmdeploy.pytorch.backends.dlinfer.cache import DlinferCacheBackend


@dataclass(frozen=True)
class PlacedLayout:
    """A cache layout whose "cuda" allocations land on `device`; "meta"/"cpu" ones stay put."""

    layout: Any
    device: str

    def _place(self, device: torch.device | str) -> torch.device | str:
        return self.device if torch.device(device).type == "cuda" else device

    def allocate(self, *args, device: torch.device | str, **kwargs):
        return self.layout.allocate(*args, device=self._place(device), **kwargs)


class HostCacheBackend(DlinferCacheBackend):
    """LMDeploy's dlinfer cache layouts (one contiguous tensor per K and V), allocated on the host."""

    torch_device: ClassVar[str] = "cpu"

    @classmethod
    def build_block_layout(cls, tensor_specs, num_layers: int):
        return PlacedLayout(super().build_block_layout(tensor_specs, num_layers), cls.torch_device)

    @classmethod
    def build_state_layout(cls, tensor_specs):
        return PlacedLayout(super().build_state_layout(tensor_specs), cls.torch_device)
