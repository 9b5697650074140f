"""The one KV-layout helper (dlinfer/vendor/kv_layouts.py): block shapes, check dims, the
canonical [NB, BS, Hkv, D] view every kernel reads through."""

import pytest
import torch

import dlinfer.vendor
from dlinfer.vendor import kv_layouts
from dlinfer.vendor.kv_layouts import HEAD_MAJOR, TOKEN_MAJOR


def test_block_shapes_and_dims():
    assert kv_layouts.block_shape(TOKEN_MAJOR, 16, 2, 64) == (16, 2, 64)
    assert kv_layouts.block_shape(HEAD_MAJOR, 16, 2, 64) == (2, 16, 64)
    assert kv_layouts.dims(TOKEN_MAJOR, 2, "D") == ("NB", "BS", 2, "D")
    assert kv_layouts.dims(HEAD_MAJOR, 2, "D") == ("NB", 2, "BS", "D")
    with pytest.raises(ValueError, match="unknown dlinfer KV layout 'heads_first'"):
        kv_layouts.block_shape("heads_first", 16, 2, 64)


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_canonical_view_addresses_the_same_elements(layout):
    nb, bs, h, d = 3, 4, 2, 5
    cache = torch.zeros((nb, *kv_layouts.block_shape(layout, bs, h, d)))
    view = kv_layouts.canonical(cache, layout)
    assert view.shape == (nb, bs, h, d) and view.data_ptr() == cache.data_ptr()
    assert kv_layouts.blocks_and_size(cache, layout) == (nb, bs)
    view[2, 3, 1] = torch.arange(d, dtype=cache.dtype)  # block 2, slot 3, head 1
    expected = cache[2, 3, 1] if layout == TOKEN_MAJOR else cache[2, 1, 3]
    assert torch.equal(expected, torch.arange(d, dtype=cache.dtype))
    assert int((cache != 0).sum()) == d - 1  # nothing else written (element 0 is 0)


def test_the_selection_function_is_not_shadowed_by_the_module():
    """`dlinfer.vendor.kv_layout()` (the selection) and `dlinfer.vendor.kv_layouts` (the helper
    module) must stay distinct names: importing a submodule sets a package attribute."""
    assert callable(dlinfer.vendor.kv_layout)
    assert dlinfer.vendor.kv_layout("cpu") in kv_layouts.KV_LAYOUTS
