"""Writing a safetensors file tensor by tensor, without a copy of the whole file in memory.

Why: `safetensors.torch.save_file` turns every tensor into a `bytes` object before it writes, so
saving N bytes of tensors costs N more bytes at the peak (5.5 GB for an 8B model's 4-bit
checkpoint). Here the header is computed from the shapes alone, then each tensor's bytes are
written straight from its storage. The format is the one dlinfer/utils/safetensors_reader.py
reads (its docstring); the file loads with `safetensors` itself (tests/test_safetensors_writer.py).
"""

from __future__ import annotations

import json
from typing import Dict, Optional

from dlinfer.utils.safetensors_reader import DTYPES

_CODES = {torch_name: code for code, torch_name in DTYPES.items()}


def write_tensors(path: str, tensors: Dict[str, "torch.Tensor"], metadata: Optional[Dict[str, str]] = None) -> None:  # noqa: F821
    """Write `tensors` (name -> CPU tensor, any layout: each is written dense, row-major) to `path`
    with the string->string `metadata`, in name order. A dtype the format has no code for is
    refused (ValueError naming the tensor) before anything is written."""
    import torch

    entries, offset = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        code = _CODES.get(str(t.dtype).replace("torch.", ""))
        if code is None:
            raise ValueError(f"safetensors: tensor {name!r} has dtype {t.dtype}, which the format cannot hold")
        if t.device.type != "cpu":
            raise ValueError(f"safetensors: tensor {name!r} is on {t.device}, expected a CPU tensor")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        entries = {"__metadata__": dict(metadata), **entries}
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors' own files do
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
