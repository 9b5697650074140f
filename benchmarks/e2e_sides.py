"""The sides `benchmarks/e2e_cpu.py` compares, each run in a worker process of its own.

A side is named `engine[-variant]`:
- `hf`: HF transformers `generate`, float32;
- `eager`, `graph`, `inductor`: LMDeploy + dlinfer on `device_type="cpu"` (eager mode, graph mode,
  graph mode with Inductor), float32; `-bf16` runs `dtype="bfloat16"`; `-w8a8` / `-w4a16` run the
  SmoothQuant / AWQ checkpoint `python -m dlinfer quantize` makes from the same folder; a
  `+int8-head` / `+int4-head` / `+float-head` suffix sets DLINFER_LM_HEAD=int8 / int4 / float in that
  side's process, a
  `+4k-pages` suffix DLINFER_HUGE_PAGES=0 (the weights left on the pages they were allocated on),
  `+ki` / `+ct` DLINFER_CPU_W4_LAYOUT=k_interleaved / column_tiled (the W4 layout, against the
  hook's own pick) (without one the engine's default, `auto`: int8 heads for the quantised
  checkpoints, float otherwise);
- `llama.cpp-f32`, `-bf16`, `-q8_0`: llama.cpp on GGUFs written from the same folder
  (`benchmarks/gguf_from_hf.py`); `llama.cpp-q4_1`: the shipped GGUF the folder was made from.

Every side's `run(b, n)` decodes exactly n greedy new tokens for the first b prompts (the end of
sequence banned) and returns the token ids; `run(1, n, ids=[...])` does the same for one prompt
given as token ids (the time-to-first-token measurement: the same ids on every side).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

LMDEPLOY_MODES = ("eager", "graph", "inductor")
LMDEPLOY_VARIANTS = {"": "float32", "bf16": "bfloat16", "w8a8": "W8A8 (SmoothQuant)", "w4a16": "W4A16"}
LLAMA_CPP_KINDS = ("f32", "bf16", "q8_0", "q4_1")
# side-name suffix -> (environment variable set in that side's process, value, label)
ENV_SUFFIXES = {
    "+int8-head": ("DLINFER_LM_HEAD", "int8", "int8 LM head"),
    "+float-head": ("DLINFER_LM_HEAD", "float", "float LM head"),
    "+int4-head": ("DLINFER_LM_HEAD", "int4", "int4 LM head"),
    "+4k-pages": ("DLINFER_HUGE_PAGES", "0", "weights on 4 KB pages"),
    "+ki": ("DLINFER_CPU_W4_LAYOUT", "k_interleaved", "W4 weights k_interleaved"),
    "+ct": ("DLINFER_CPU_W4_LAYOUT", "column_tiled", "W4 weights column_tiled"),
    "+unbound": ("DLINFER_GRAPH_BIND", "0", "graph call sites on the op functions"),
    "+a8": ("DLINFER_CPU_W4_ACTIVATIONS", "int8", "8-bit activations for W4"),
    "+a16": ("DLINFER_CPU_W4_ACTIVATIONS", "int16", "16-bit integer activations for W4"),
    "+native": ("DLINFER_CPU_W4_ACTIVATIONS", "native", "W4 activations at their own precision"),
    "+1-stream": ("DLINFER_CPU_WEIGHT_STREAMS", "1", "weight streams set to 1"),
    "+static-batch": ("DLINFER_GRAPH_BATCH", "static", "one decode graph traced per batch bucket"),
}


def all_sides() -> dict[str, str]:
    """side name -> label for the report."""
    sides = {"hf": "HF transformers, float32"}
    for mode in LMDEPLOY_MODES:
        for variant, label in LMDEPLOY_VARIANTS.items():
            name = f"{mode}-{variant}" if variant else mode
            sides[name] = f"LMDeploy + dlinfer {mode}, {label}"
            for suffix, (_, _, what) in ENV_SUFFIXES.items():
                sides[name + suffix] = f"LMDeploy + dlinfer {mode}, {label}, {what}"
            if variant == "w4a16":  # the fastest 4-bit decode: both opt-ins
                sides[name + "+a8+int4-head"] = (f"LMDeploy + dlinfer {mode}, {label}, {ENV_SUFFIXES['+a8'][2]}, "
                                                 f"{ENV_SUFFIXES['+int4-head'][2]}")
    for kind in LLAMA_CPP_KINDS:
        sides[f"llama.cpp-{kind}"] = f"llama.cpp, {kind}"
    return sides


SIDES = all_sides()


def add_w4_arguments(parser) -> None:
    """--w4-method and --group-size: how the W4A16 sides' checkpoint is made (`quantized_folder`),
    for every script that runs these sides."""
    parser.add_argument("--w4-method", default="awq", choices=("awq", "rtn"),
                        help="how the W4A16 sides' checkpoint is quantised (default awq, minutes the first time; "
                             "rtn is quicker on big models)")
    parser.add_argument("--group-size", type=int, default=64, help="the W4A16 group size (default 64)")


def quantized_folder(folder: Path, method: str, log=print, group_size: int = 64, w4_method: str = "awq") -> Path:
    """The `python -m dlinfer quantize` checkpoint of `folder` (method smooth_quant, or the W4A16
    one: `w4_method` awq or rtn at `group_size`), made once and cached beside it. SmolLM2's default
    is AWQ at group 64 (its K = 576 is no multiple of 128), the folder scripts/main_job.py --w4a16
    makes and uses too (named by `writer.cache_name`, which carries the method's recipe tag: a
    folder written before the method changed is not reused)."""
    from dlinfer.quantize.writer import cache_name

    if method != "smooth_quant":
        method = w4_method
    out = folder.parent / cache_name(folder.name, method, group_size)
    if not (out / "config.json").is_file():
        log(f"[e2e] quantizing {folder.name} with {method} (once)")
        extra = ["--group-size", str(group_size)] if method != "smooth_quant" else []
        subprocess.run([sys.executable, "-m", "dlinfer", "quantize", str(folder), str(out), "--method", method, *extra],
                       check=True, stdout=sys.stderr)
    return out


def hf_side(folder: Path, prompts: list[str]) -> Callable[[int, int], list]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def run(batch: int, n: int, ids: list | None = None) -> list:
        if ids is not None:
            enc = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        else:
            enc = tokenizer(prompts[:batch], return_tensors="pt", padding=True, add_special_tokens=False,
                            return_token_type_ids=False)
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=tokenizer.pad_token_id)
        assert out.shape[1] == enc["input_ids"].shape[1] + n
        return out[:, enc["input_ids"].shape[1]:].tolist()

    return run


def lmdeploy_side(folder: Path, prompts: list[str], mode: str, variant: str, quant: dict | None = None):
    """(run, pipe) through LMDeploy's pipeline on device_type="cpu"."""
    from lmdeploy import PytorchEngineConfig, pipeline

    import dlinfer.framework.lmdeploy_ext  # noqa: F401  (the device type "cpu")
    from dlinfer.tools import decode_timing

    if mode == "inductor":
        os.environ["DLINFER_GRAPH_COMPILER"] = "inductor"  # read when the graph runner is built
    # the float sides ask for their dtype (dtype="auto" keeps a bf16 checkpoint in bf16 on CPU); the
    # quantised ones run in the checkpoint's own dtype, as a user's would
    dtype = {"bf16": "bfloat16", "": "float32"}.get(variant, "auto")
    if variant in ("w8a8", "w4a16"):
        folder = quantized_folder(folder, "smooth_quant" if variant == "w8a8" else "awq",
                                  log=lambda msg: print(msg, file=sys.stderr), **(quant or {}))
    config = PytorchEngineConfig(device_type="cpu", max_batch_size=8, num_gpu_blocks=64, eager_mode=mode == "eager",
                                 dtype=dtype)
    pipe = pipeline(str(folder), backend_config=config, log_level="ERROR")

    generate = decode_timing.generator(pipe)  # the method shared with python -m dlinfer bench

    def run(batch: int, n: int, ids: list | None = None) -> list:
        return generate(batch, n, prompts=prompts, ids=ids)

    return run, pipe


def llamacpp_side(folder: Path, prompts: list[str], kind: str):
    """(run, closer) through llama.cpp (benchmarks/llamacpp_side.py)."""
    from gguf_from_hf import gguf_for
    from llamacpp_side import LlamaCppGreedy
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    gguf = gguf_for(kind, folder, log=lambda msg: print(msg, file=sys.stderr))
    runner = LlamaCppGreedy(gguf)
    single = []  # a one-sequence context for long prompts (the batch context gives each sequence 512)

    def run(batch: int, n: int, ids: list | None = None) -> list:
        if ids is None:
            return runner.run(prompt_ids[:batch], n)
        if not single:
            single.append(LlamaCppGreedy(gguf, max_batch=1, ctx_per_seq=4096))
        return single[0].run([ids], n)

    class Closer:
        def close(self):
            for r in (runner, *single):
                r.close()

    return run, Closer()


def make_side(side: str, folder: Path, prompts: list[str], quant: dict | None = None):
    """(run(b, n) -> token ids, closable or None) for the side named `side`; quant: quantized_folder's
    group_size and w4_method for the W4A16 sides."""
    if side == "hf":
        return hf_side(folder, prompts), None
    stripped = True
    while stripped:  # suffixes in any number and order
        stripped = False
        for suffix, (variable, value, _) in ENV_SUFFIXES.items():
            if side.endswith(suffix):
                os.environ[variable] = value  # read when the engine is built
                side = side[:-len(suffix)]
                stripped = True
    engine, _, variant = side.partition("-")
    if engine in LMDEPLOY_MODES:
        return lmdeploy_side(folder, prompts, engine, variant, quant)
    if engine == "llama.cpp":
        return llamacpp_side(folder, prompts, variant)
    raise ValueError(f"unknown side {side!r}; known: {', '.join(SIDES)}")
