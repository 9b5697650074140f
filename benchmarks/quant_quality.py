"""Perplexity of SmolLM2-135M-Instruct on a held-out local text: float32, RTN 4-bit, AWQ 4-bit and
SmoothQuant W8A8, the checkpoints written by `python -m dlinfer quantize` (docs/quantize.md).

    .venv/bin/python benchmarks/quant_quality.py [--model DIR]
        [--runs rtn:64,awq:64,awq:32,smooth_quant,awq-a8:64,awq-a16:64]
        [--text FILE [--text FILE ...]] [--work DIR] [--calib FILE] [--calib-samples N] [--calib-seqlen N]

The quantised models are evaluated as HF transformers running exactly what LMDeploy's CPU engine
computes (tests/lmdeploy/test_quantized.py checks the greedy tokens are equal): the weights
dequantised from the written files, and for SmoothQuant each quantised linear's input
fake-quantised per token (tests/support/quantized_models.py builds both). A run `rtn-a8` or
`awq-a8` evaluates that 4-bit checkpoint with its linears' inputs quantised per row and group as
DLINFER_CPU_W4_ACTIVATIONS=int8 runs them; `rtn-a16` / `awq-a16` as int16 (the AVX2 builds' default
for bfloat16 models) runs them, at every row count (the engine takes BLAS on float
inputs past 256 rows instead: these runs round more than it does). The held-out texts
(benchmarks/data/heldout.txt, 832 tokens, heldout_long.txt, 3942 tokens on other topics, and
heldout_fresh.txt, 1914 tokens written after the AWQ recipe was fixed and never used to choose it,
all three written for this project) are not the calibration or tuning texts
(dlinfer/quantize/data/calibration.txt, tuning.txt).
Perplexity over non-overlapping windows of --window tokens, one column per text.

Each model is evaluated with the float LM head and with the int8 LM head (DLINFER_LM_HEAD, which
the engine's default `auto` uses for the quantised checkpoints): the head's weight rounded per
output row and its input per token (quantized_models.fake_quant_lm_head). --lm-head picks one, or
`all` adds the opt-in int4 head (4 bits per group of 32 input channels, the input float:
quantized_models.fake_quant_lm_head_int4).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.quantized_models (the fake-quant references)
sys.path.insert(0, str(ROOT / "scripts"))             # smollm2 (builds the float folder from the GGUF)

# run-name suffix -> DLINFER_CPU_W4_ACTIVATIONS the same checkpoint is evaluated under
ACTIVATION_SUFFIXES = {"-a8": "int8", "-a16": "int16"}


def perplexity(model, ids, window: int) -> float:
    import torch

    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window + 1]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            nll += loss.item()
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dlinfer.quantize.cli import quantize
    from dlinfer.utils import machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="float HF folder (default: SmolLM2, built once)")
    parser.add_argument("--runs", default="rtn:64,awq:64,awq:32,smooth_quant",
                        help="comma-separated METHOD[:GROUP] (4-bit methods need a group dividing SmolLM2's "
                             "K = 576: 64 or 32); awq-noclip is awq without the clipping search")
    parser.add_argument("--text", type=Path, action="append", default=None,
                        help="held-out text (repeatable; default: benchmarks/data/heldout.txt, heldout_long.txt and "
                             "heldout_fresh.txt)")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--work", type=Path, default=None, help="where the quantised folders go (default: a temp dir)")
    parser.add_argument("--calib", type=Path, default=None,
                        help="calibration text (default: the quantize CLI's, dlinfer/quantize/data/calibration.txt)")
    parser.add_argument("--calib-samples", type=int, default=64, help="at most this many samples (default 64)")
    parser.add_argument("--calib-seqlen", type=int, default=128, help="tokens per sample (default 128)")
    parser.add_argument("--lm-head", choices=("float", "int8", "int4", "both", "all"), default="both",
                        help="the LM head(s) to evaluate every model with (default: both, float and int8; all adds "
                             "int4)")
    args = parser.parse_args(argv)
    heads = {"both": ("float", "int8"), "all": ("float", "int8", "int4")}.get(args.lm_head, (args.lm_head,))
    if args.model is None:
        from smollm2 import build_smollm2

        args.model = build_smollm2()
    from support.quantized_models import FakeQuantReference, fake_quant_lm_head, fake_quant_lm_head_int4

    texts = args.text or [ROOT / "benchmarks" / "data" / name for name in ("heldout.txt", "heldout_long.txt",
                                                                                  "heldout_fresh.txt")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = [tokenizer(text.read_text(), add_special_tokens=False)["input_ids"] for text in texts]
    print(f"machine: {machine.cpu_model()}; torch threads {torch.get_num_threads()}")
    for text, one in zip(texts, ids):
        print(f"held-out text: {text.name}, {len(one)} tokens, windows of {args.window}")
    rows = []
    for head in heads:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        if head == "int8":
            fake_quant_lm_head(model)
        elif head == "int4":
            fake_quant_lm_head_int4(model)
        rows.append(("float32", "-", head, [perplexity(model, one, args.window) for one in ids], 0.0))
    work = args.work or Path(tempfile.mkdtemp(prefix="dlinfer-quality-"))
    labels = {"rtn": "RTN 4-bit (W4A16)", "awq": "AWQ 4-bit (W4A16)", "awq-noclip": "AWQ 4-bit, no clipping",
              "smooth_quant": "SmoothQuant W8A8", "rtn-a8": "RTN 4-bit, 8-bit activations",
              "awq-a8": "AWQ 4-bit, 8-bit activations",
              "rtn-a16": "RTN 4-bit, 16-bit activations", "awq-a16": "AWQ 4-bit, 16-bit activations"}
    for run in args.runs.split(","):
        method, _, group = run.partition(":")
        group_size = int(group or 64)
        suffix = next((s for s in ACTIVATION_SUFFIXES if method.endswith(s)), "")
        activations = ACTIVATION_SUFFIXES.get(suffix, "native")
        folder_method = method.removesuffix(suffix)
        dst = work / (f"{args.model.name}-{folder_method}" + (f"-g{group_size}" if method != "smooth_quant" else ""))
        start = time.perf_counter()
        if not dst.exists():
            quantize(args.model, dst, folder_method.replace("-noclip", ""), group_size=group_size, calib=args.calib,
                     calib_seqlen=args.calib_seqlen, calib_samples=args.calib_samples, log=lambda line: None,
                     clip=not method.endswith("-noclip"))
        seconds = time.perf_counter() - start
        for head in heads:
            model = FakeQuantReference(dst, int8_head=head == "int8", int4_head=head == "int4",
                                       activations=activations).model
            ppl = [perplexity(model, one, args.window) for one in ids]
            rows.append((labels[method], f"g{group_size}" if method != "smooth_quant" else "per channel / per token",
                         head, ppl, seconds))
            print(f"{labels[method]} {rows[-1][1]} ({head} head): perplexity "
                  f"{', '.join(f'{p:.3f}' for p in ppl)}, quantised in {seconds:.0f} s", flush=True)
    base = rows[0][3]
    columns = " | ".join(f"{text.name} | vs float32 ({rows[0][2]} head)" for text in texts)
    print(f"\n| model | grouping | LM head | {columns} | quantise time (s) |")
    print("|---|---|---|" + "---|---|" * len(texts) + "---|")
    for label, grouping, head, ppl, seconds in rows:
        cells = " | ".join(f"{p:.3f} | {100 * (p / b - 1):+.2f}%" for p, b in zip(ppl, base))
        print(f"| {label} | {grouping} | {head} | {cells} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
