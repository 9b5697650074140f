"""The DST folder: written into a staging folder beside it and renamed into place at the end, so
a DST that exists is complete. Everything of SRC but its weights and config.json is copied
(tokenizer, generation config, chat template)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dlinfer.quantize.source import QuantizeInputError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SKIPPED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QuantizeInputError(f"quantize: DST {str(dst)!r} exists and is not an empty folder; choose a new "
                                 "path or remove it.")


def quantization_config(method: str, group_size: int) -> dict:
    """The `quantization_config` LMDeploy 0.18 reads (pytorch/config.py, QuantizationConfig)."""
    if method in ("awq", "rtn"):
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if method == "smooth_quant":
        return {"quant_method": "smooth_quant", "quant_dtype": "int8"}
    raise QuantizeInputError(f"quantize: unknown method {method!r}.")


def write(src: Path, dst: Path, config: dict, tensors: dict, extra_files: dict | None = None) -> None:
    """Write config.json, model.safetensors (`tensors`: name -> tensor) and `extra_files`
    (name -> writer(path)) into DST, with SRC's other non-weight files."""
    from safetensors.torch import save_file

    check_destination(dst)
    staging = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for item in src.iterdir():
            if item.is_file() and item.name not in _SKIPPED and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        for name, write_file in (extra_files or {}).items():
            write_file(staging / name)
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
