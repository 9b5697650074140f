"""llama.cpp's own `llama-bench` as an optional side of `benchmarks/e2e_cpu.py --model DIR`.

Not part of the README commands: it needs a llama.cpp tree built by hand, for example from the
llama-cpp-python source distribution (which carries llama.cpp under `vendor/llama.cpp`):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build build --target llama-bench llama-quantize -j2

(on a CPU with AMX-INT8, `-DGGML_NATIVE=OFF` and the ISA flags without AMX: docs/benchmarks.md, "A second
machine: a 2-core Intel Xeon with AMX"), then `LLAMA_CPP_DIR=<that tree>` or `--llama-cpp-dir`.

GGUFs are made from the same HF folder the other sides run, cached beside it as
`<folder>.<kind>.gguf`: f32 / bf16 / q8_0 by the tree's `convert_hf_to_gguf.py` (its own `gguf-py`
on PYTHONPATH), Q4_0 / Q4_K_M / Q4_1 by `llama-quantize` from the bf16 one (their LM head in Q6_K, as
llama-quantize chooses; `q4_0-q4head`: Q4_0 with the head in Q4_0 too). A decode rate is
`llama-bench -m GGUF -p 0 -n N -t THREADS -r 1 -o csv`: N new tokens from an empty context,
tokens/s as llama-bench reports it (`avg_ts`).
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

CONVERTED = {"f32": "f32", "bf16": "bf16", "q8_0": "q8_0"}  # convert_hf_to_gguf --outtype
# llama-quantize type and options, from the bf16 GGUF. llama-quantize keeps the LM head (`output`, or a tied
# `token_embd`) in Q6_K; `q4_0-q4head` asks for Q4_0 there too (`--output-tensor-type`), the like-for-like
# side of dlinfer's opt-in int4 head.
QUANTIZED = {"q4_0": ("Q4_0", ()), "q4_k_m": ("Q4_K_M", ()), "q4_1": ("Q4_1", ()),
             "q4_0-q4head": ("Q4_0", ("--output-tensor-type", "q4_0"))}
KINDS = (*CONVERTED, *QUANTIZED)


class LlamaCpp:
    """A built llama.cpp tree: `root` holds convert_hf_to_gguf.py, gguf-py/ and build/bin/."""

    def __init__(self, root: str | os.PathLike | None = None):
        root = root or os.environ.get("LLAMA_CPP_DIR")
        if not root:
            raise FileNotFoundError("no llama.cpp tree: set LLAMA_CPP_DIR or pass --llama-cpp-dir (see "
                                    "benchmarks/llama_bench.py for how to build one)")
        self.root = Path(root)
        self.bench = self.root / "build" / "bin" / "llama-bench"
        self.quantize = self.root / "build" / "bin" / "llama-quantize"
        for path in (self.root / "convert_hf_to_gguf.py", self.bench, self.quantize):
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: build llama-bench and llama-quantize first "
                                        "(benchmarks/llama_bench.py)")

    def gguf(self, folder: Path, kind: str, log=print) -> Path:
        """The GGUF of `kind` made from the HF folder (cached beside it)."""
        if kind not in KINDS:
            raise ValueError(f"llama.cpp kind {kind!r}: expected one of {', '.join(KINDS)}")
        out = folder.parent / f"{folder.name}.{kind}.gguf"
        if out.is_file() and out.stat().st_mtime >= (folder / "config.json").stat().st_mtime:
            return out
        partial = out.with_name(out.name + ".partial")
        if kind in CONVERTED:
            # llama.cpp's converter reads tokenizer.json; a tokenizer.model that is not a sentencepiece file
            # (newer transformers write a GGUF's copy there) breaks it: the folder here has none
            log(f"[llama.cpp] converting {folder.name} to {kind}")
            env = dict(os.environ, PYTHONPATH=str(self.root / "gguf-py"))
            subprocess.run([sys.executable, str(self.root / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                            str(partial), "--outtype", CONVERTED[kind]], check=True, env=env, stdout=sys.stderr)
        else:
            source = self.gguf(folder, "bf16", log)
            qtype, options = QUANTIZED[kind]
            log(f"[llama.cpp] quantizing {source.name} to {qtype} {' '.join(options)}".rstrip())
            subprocess.run([str(self.quantize), *options, str(source), str(partial), qtype], check=True,
                           stdout=sys.stderr, stderr=sys.stderr)
        partial.replace(out)
        return out

    def decode_rate(self, gguf: Path, new_tokens: int, threads: int) -> float:
        """Tokens/s of `llama-bench -p 0 -n new_tokens` (one repetition)."""
        done = subprocess.run([str(self.bench), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
                               "-r", "1", "-o", "csv"], capture_output=True, text=True, check=True)
        rows = list(csv.DictReader(io.StringIO(done.stdout)))
        if not rows or "avg_ts" not in rows[-1]:
            raise RuntimeError(f"llama-bench printed no avg_ts column: {done.stdout[-500:]!r}")
        return float(rows[-1]["avg_ts"])


def gguf_step_bytes(gguf: Path) -> int:
    """Bytes a decode step reads from the GGUF: every tensor but the token embedding table, unless
    the model has no separate `output` tensor (tied: the head reads the table)."""
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(str(gguf))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes.get("token_embd.weight", 0)
    return total
