"""dlinfer.utils.safetensors_reader: the tensors safetensors itself loads, bit for bit, read without
a memory map; malformed files named with what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlinfer.utils.safetensors_reader import FormatError, read_tensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(7, 13, generator=g),
        "bf16": torch.randn(300, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 4, 5, generator=g).half(),
        "f64": torch.randn(2, generator=g, dtype=torch.float64),
        "i32": torch.randint(-2**31, 2**31 - 1, (9, 8), generator=g, dtype=torch.int32),
        "i64": torch.randint(-2**40, 2**40, (4,), generator=g, dtype=torch.int64),
        "i8": torch.randint(-128, 127, (33,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 2), generator=g, dtype=torch.uint8),
        "bool": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
    }


def test_every_tensor_is_what_safetensors_loads(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    got = dict(read_tensors(str(path)))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else got[name],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), name


def test_the_prefix_and_the_file_order(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"b": torch.ones(3), "a": torch.zeros(2)}, str(path))
    names = [n for n, _ in read_tensors(str(path), prefix="model.")]
    assert sorted(names) == ["model.a", "model.b"] and len(names) == 2


def _raw(path, header: dict, data: bytes):
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + data)


@pytest.mark.parametrize("header,data,message", [
    ({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0", "dtype 'Q4'"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, "expected 8"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "within the file"),
])
def test_malformed_files_are_named(tmp_path, header, data, message):
    path = tmp_path / "bad.safetensors"
    _raw(path, header, data)
    with pytest.raises(FormatError, match=message) as info:
        list(read_tensors(str(path)))
    assert str(path) in str(info.value)


def test_a_truncated_header_is_named(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x00")
    with pytest.raises(FormatError, match="shorter than a safetensors header"):
        list(read_tensors(str(path)))
    path.write_bytes((50).to_bytes(8, "little") + b"{not json")
    with pytest.raises(FormatError, match="not JSON"):
        list(read_tensors(str(path)))
