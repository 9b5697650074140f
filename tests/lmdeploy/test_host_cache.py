"""The CPU device type's KV-cache allocation: LMDeploy's contiguous layout, on 2 MB pages."""

import torch

import dlinfer.framework.lmdeploy_ext  # noqa: F401
from dlinfer.framework.lmdeploy_ext.backend.cache import HostCacheBackend
from dlinfer.utils.hugepages import empty_on_huge_pages, use_huge_pages
from lmdeploy.pytorch.engine.cache_engine.schema import CacheDesc, CacheTensorSpec


def _specs():
    return (CacheTensorSpec("k", CacheDesc([16, 2, 32], torch.float32)),
            CacheTensorSpec("v", CacheDesc([16, 2, 24], torch.bfloat16)))


def test_block_cache_matches_lmdeploys_own_allocation():
    placed = HostCacheBackend.build_block_layout(_specs(), num_layers=3)
    ours = placed.allocate(40, device="cuda")  # LMDeploy asks for "cuda": the host gets it
    theirs = placed.layout.allocate(40, device="cpu")
    assert len(ours.tensor_views) == len(theirs.tensor_views) == 2
    for mine, ref in zip(ours.tensor_views, theirs.tensor_views):
        assert mine.device.type == "cpu" and mine.shape == ref.shape and mine.dtype == ref.dtype
        assert mine.is_contiguous() and not mine.any()  # zeroed, like LMDeploy's torch.zeros
    assert [p.entry_axis for p in ours.pools] == [p.entry_axis for p in theirs.pools]
    assert ours.nbytes == theirs.nbytes


def test_meta_sizing_is_left_to_lmdeploy():
    placed = HostCacheBackend.build_block_layout(_specs(), num_layers=2)
    meta = placed.allocate(8, device="meta")
    assert all(t.device.type == "meta" for t in meta.tensor_views)


def test_huge_page_helpers_keep_contents():
    t = empty_on_huge_pages((3 << 20,), torch.float32)  # 12 MB: several 2 MB pages
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    expected = t.clone()
    assert isinstance(use_huge_pages(t), bool)  # a hint: the kernel may refuse
    assert torch.equal(t, expected)
    assert use_huge_pages(torch.ones(10)) is False  # smaller than one 2 MB page
