"""The CPU device type's KV-cache allocation: LMDeploy's own layouts, placed on the host."""

import torch
from lmdeploy.pytorch.engine.cache_engine.schema import CacheDesc, CacheTensorSpec

import dlinfer.framework.lmdeploy_ext  # noqa: F401
from dlinfer.framework.lmdeploy_ext.backend.cache import HostCacheBackend


def _specs():
    return (CacheTensorSpec("k", CacheDesc([16, 2, 32], torch.float32)),
            CacheTensorSpec("v", CacheDesc([16, 2, 24], torch.bfloat16)))


def test_block_cache_requested_on_cuda_lands_on_the_host():
    placed = HostCacheBackend.build_block_layout(_specs(), num_layers=3)
    ours = placed.allocate(40, device="cuda")  # LMDeploy asks for "cuda": the host gets it
    theirs = placed.layout.allocate(40, device="cpu")
    assert len(ours.tensor_views) == len(theirs.tensor_views) == 2
    for mine, ref in zip(ours.tensor_views, theirs.tensor_views):
        assert mine.device.type == "cpu" and mine.shape == ref.shape and mine.dtype == ref.dtype
        assert mine.is_contiguous() and not mine.any()
    assert ours.nbytes == theirs.nbytes


def test_meta_sizing_is_left_to_lmdeploy():
    placed = HostCacheBackend.build_block_layout(_specs(), num_layers=2)
    meta = placed.allocate(8, device="meta")
    assert all(t.device.type == "meta" for t in meta.tensor_views)
