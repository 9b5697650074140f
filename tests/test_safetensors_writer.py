"""dlinfer.utils.safetensors_writer against safetensors' own reader."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dlinfer.utils.safetensors_reader import read_tensors
from dlinfer.utils.safetensors_writer import write_tensors


def _tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(7, 5, generator=g).bfloat16(),
        "a.qweight": torch.randint(-2**31, 2**31 - 1, (3, 8), generator=g, dtype=torch.int32),
        "scales": torch.randn(2, 9, generator=g).half().T,  # not contiguous: written dense
        "int8": torch.randint(-128, 127, (4, 4), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "flag": torch.tensor([True, False, True]),
        "f32": torch.randn(1, 3, 2, generator=g),
    }


def test_safetensors_reads_back_every_tensor_and_the_metadata(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "model.safetensors")
    write_tensors(path, tensors, {"format": "pt"})
    got = load_file(path)
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert {n: t for n, t in read_tensors(path)}.keys() == tensors.keys()


def test_an_unwritable_tensor_is_named_before_anything_is_written(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="tensor 'c' has dtype torch.complex64"):
        write_tensors(str(path), {"a": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)})
    assert not path.exists()
