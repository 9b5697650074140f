"""Reading a safetensors file tensor by tensor with plain reads, not a memory map.

Why: `safetensors.safe_open` maps the whole file, and every tensor it hands out is a view of that
mapping. The pages a loader has touched stay in the process's resident set (as file-backed RSS)
until the file is closed: loading one 5 GB shard into a model's own tensors holds the shard and
the copies at once. On a machine whose RAM the weights nearly fill (an 8B model in bf16 on 24 GB),
that peak is what decides whether the model loads. Here each tensor is read (`readinto`) into a
fresh tensor of its own, which the caller copies where it belongs and drops: the process holds at
most one tensor beyond its model, and the file's pages stay in the page cache, which the kernel
reclaims as it needs (they are not part of the process).

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a
JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then
the data, each tensor's bytes little-endian and dense at data_offsets from the data's start.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Optional, Tuple

DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_MAX_HEADER = 100 << 20  # the format's own limit on the header's length


class FormatError(ValueError):
    """The file is not a safetensors file this reader understands (named, with the reason)."""


def header(path: str) -> Tuple[dict, int]:
    """(the header without "__metadata__", the data's offset in the file)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise FormatError(f"{path}: shorter than a safetensors header")
        n = int.from_bytes(raw, "little")
        if n > _MAX_HEADER:
            raise FormatError(f"{path}: header length {n} is over the format's limit")
        try:
            meta = json.loads(f.read(n))
        except ValueError as exc:
            raise FormatError(f"{path}: the header is not JSON ({exc})") from None
    meta.pop("__metadata__", None)
    return meta, 8 + n


def read_tensors(path: str, prefix: Optional[str] = None) -> Iterator[Tuple[str, "torch.Tensor"]]:  # noqa: F821
    """(name, tensor) for every tensor of the file, in file order, each a new CPU tensor read from the
    file (names prefixed with `prefix` when given). A FormatError names the file and what is wrong
    (an unknown dtype, a tensor whose bytes do not fit its shape or lie past the file's end)."""
    import torch

    meta, base = header(path)
    size = os.path.getsize(path)
    entries = sorted(meta.items(), key=lambda item: item[1]["data_offsets"][0])
    with open(path, "rb", buffering=0) as f:
        for name, info in entries:
            dtype = getattr(torch, DTYPES.get(info["dtype"], ""), None)
            if not isinstance(dtype, torch.dtype):
                raise FormatError(f"{path}: tensor {name!r} has dtype {info['dtype']!r}, "
                                  "which this reader does not know")
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if end - begin != nbytes or base + end > size:
                raise FormatError(f"{path}: tensor {name!r} ({info['dtype']} {info['shape']}) has {end - begin} "
                                  f"bytes at "
                                  f"{begin}..{end}, expected {nbytes} within the file's {size - base} data bytes")
            if nbytes:
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                f.seek(base + begin)
                done = 0
                while done < nbytes:
                    got = f.readinto(view[done:])
                    if not got:
                        raise FormatError(f"{path}: the file ended inside tensor {name!r}")
                    done += got
            yield (prefix + name if prefix else name), tensor
