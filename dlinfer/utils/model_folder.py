"""Is MODEL a HF checkpoint folder that LMDeploy can load? Checked before any engine starts, so a
wrong path is one line naming the problem (the commands turn it into exit status 2), not a
traceback from deep inside transformers or LMDeploy's engine process.

What is checked, cheaply (the safetensors headers only, no weights read): the path is a folder,
not a file (a GGUF file is named as such, with what to do); it holds config.json as valid JSON,
a tokenizer, and weights; every safetensors file's header parses and its tensors end inside the
file (a truncated download is named).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelFolderError(ValueError):
    """MODEL is not a checkpoint folder this machine can load (the message says why)."""


def check_model_folder(path, what: str = "MODEL", tokenizer: bool = True) -> dict:
    """config.json of the checkpoint folder `path`, after the checks above; ModelFolderError
    naming `what` and the problem otherwise. tokenizer=False skips the tokenizer check."""
    from dlinfer.utils import safetensors_reader

    folder = Path(path)
    if folder.is_file():
        if folder.suffix == ".gguf":
            raise ModelFolderError(
                f"{what} {str(folder)!r} is a GGUF file; LMDeploy loads HF checkpoint folders (config.json and "
                "safetensors). Convert it with transformers: AutoModelForCausalLM.from_pretrained(folder, "
                "gguf_file=name).save_pretrained(out), and the same for AutoTokenizer (scripts/smollm2.py does so).")
        raise ModelFolderError(f"{what} {str(folder)!r} is a file, not a HF checkpoint folder.")
    if not folder.is_dir():
        raise ModelFolderError(f"{what} {str(folder)!r} does not exist.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFolderError(f"{what} {str(folder)!r} has no config.json: not a HF checkpoint folder.")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"{what}: {config_path} is not valid JSON ({exc}).") from None
    if not any((folder / name).is_file() for name in WEIGHT_FILES) and not list(folder.glob("*.safetensors")):
        raise ModelFolderError(f"{what} {str(folder)!r} has no weights (expected one of {', '.join(WEIGHT_FILES)}).")
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFolderError(f"{what} {str(folder)!r} has no tokenizer (expected one of "
                               f"{', '.join(TOKENIZER_FILES)}).")
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            meta, base = safetensors_reader.header(str(shard))
            end = max((entry["data_offsets"][1] for entry in meta.values()), default=0)
        except (safetensors_reader.FormatError, KeyError, TypeError, IndexError) as exc:
            raise ModelFolderError(f"{what}: {shard} is not a readable safetensors file ({exc}).") from None
        size = os.path.getsize(shard)
        if base + end > size:
            raise ModelFolderError(f"{what}: {shard} is truncated ({size} bytes, its header needs {base + end}): "
                                   "download or copy it again.")
    return config
