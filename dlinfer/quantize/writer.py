"""The DST folder: written into a staging folder beside it and renamed into place at the end, so
a DST that exists is complete. Everything of SRC but its weights and config.json is copied
(tokenizer, generation config, chat template)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dlinfer.quantize.source import QuantizeInputError

STAMP_FILE = "dlinfer_quantize.json"
# A tag per method, changed whenever what the method writes changes (awq: "clip" with the
# weight-clipping search, "duo-clip" since the duo scales and the clipping of q/k too,
# "duo-clip-tune" since the tuning of the scales and norms), so that callers caching a checkpoint under
# `cache_name` (scripts/main_job.py --w4a16, benchmarks/e2e_sides.py) never reuse a folder the
# older code wrote. The default options' recipe; `stamp` records the one a run used. The tag
# follows the weights written: a folder from before the LM head's input ranges were recorded
# (lm_head_input_absmax.safetensors) has the same weights and runs with an unsmoothed int8 head.
RECIPE_TAGS = {"awq": "duo-clip-tune", "rtn": "", "smooth_quant": ""}

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SKIPPED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QuantizeInputError(f"quantize: DST {str(dst)!r} exists and is not an empty folder; choose a new "
                                 "path or remove it.")


def _staging(dst: Path, pid: int) -> Path:
    return dst.parent / f".{dst.name}.partial-{pid}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clear_interrupted_runs(dst: Path, log=print) -> None:
    """Remove the staging folders (`.DST.partial-PID`) that runs writing DST left when they were
    killed before the rename (SIGKILL, OOM, power); a staging folder whose process still runs
    means another quantize is writing DST now, which is refused."""
    for staging in sorted(dst.parent.glob(f".{dst.name}.partial-*")):
        pid = staging.name.rsplit("-", 1)[1]
        if not pid.isdigit() or not staging.is_dir():
            continue
        if int(pid) != os.getpid() and _running(int(pid)):
            raise QuantizeInputError(f"quantize: another process (pid {pid}) is writing DST {str(dst)!r} "
                                     f"into {staging}; wait for it, or remove that folder if no quantize runs.")
        shutil.rmtree(staging, ignore_errors=True)
        log(f"quantize: removed {staging}, left by an interrupted run (pid {pid})")


def cache_name(src_name: str, method: str, group_size: int = 64) -> str:
    """The folder name a cached checkpoint of SRC gets: `SRC-awq-g64-duo-clip`, `SRC-rtn-g64`,
    `SRC-smooth_quant`."""
    parts = [src_name, method] + ([f"g{group_size}"] if method in ("awq", "rtn") else [])
    return "-".join(parts + ([RECIPE_TAGS[method]] if RECIPE_TAGS[method] else []))


def stamp(method: str, group_size: int, clip: bool, calib_shape: tuple, tune_steps: int = 0,
          tune_shape: tuple | None = None, tune_kl: tuple | None = None) -> dict:
    """What DST/dlinfer_quantize.json records: how the checkpoint was made (for awq: the recipe
    tag of the options used, "duo-clip-tune" with the defaults)."""
    out = {"method": method, "recipe": RECIPE_TAGS[method], "calib_samples": list(calib_shape)}
    if method in ("awq", "rtn"):
        out["group_size"] = group_size
    if method == "awq":
        out["clip"] = clip
        out["scales"] = "duo"
        out["recipe"] = "duo-" + ("clip" if clip else "noclip") + ("-tune" if tune_steps else "")
        out["tune"] = ({"steps": tune_steps, "samples": list(tune_shape), "kl_before": round(tune_kl[0], 6),
                        "kl_after": round(tune_kl[1], 6)} if tune_steps else None)
    return out


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
    from dlinfer.utils.safetensors_writer import write_tensors

    check_destination(dst)
    staging = _staging(dst, os.getpid())
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for item in src.iterdir():
            if item.is_file() and item.name not in _SKIPPED and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # tensor by tensor: safetensors' save_file would hold a copy of the whole file in memory
        write_tensors(str(staging / "model.safetensors"), tensors, metadata={"format": "pt"})
        for name, write_file in (extra_files or {}).items():
            write_file(staging / name)
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
