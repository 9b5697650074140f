"""Things that are not loadable model folders, for the tests of the one-line refusals
(dlinfer/utils/model_folder.py, through `serve` and `quantize`)."""

from __future__ import annotations

from pathlib import Path


def gguf_file(folder: Path) -> Path:
    """A file named like a GGUF model in `folder` (its contents are never read)."""
    (folder / "m.gguf").write_bytes(b"GGUF")
    return folder / "m.gguf"


def truncated(folder: Path, missing_bytes: int) -> Path:
    """`folder` with the last `missing_bytes` of its model.safetensors cut off, as an interrupted copy."""
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-missing_bytes])
    return folder
