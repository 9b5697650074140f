"""Perplexity of SmolLM2-135M-Instruct on a held-out local text: float32, RTN 4-bit, AWQ 4-bit and
SmoothQuant W8A8, the checkpoints written by `python -m dlinfer quantize` (docs/quantize.md).

    .venv/bin/python benchmarks/quant_quality.py [--model DIR] [--runs rtn:64,awq:64,awq:32,smooth_quant]
        [--text FILE] [--work DIR]

The quantised models are evaluated as HF transformers running exactly what LMDeploy's CPU engine
computes (tests/lmdeploy/test_quantized.py checks the greedy tokens are equal): the weights
dequantised from the written files, and for SmoothQuant each quantised linear's input
fake-quantised per token (tests/lmdeploy/quantized_models.py builds both). The held-out text
(benchmarks/data/heldout.txt, written for this project) is not the calibration corpus
(dlinfer/quantize/data/calibration.txt). Perplexity over non-overlapping windows of --window tokens.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "lmdeploy"))  # quantized_models (the fake-quant references)
sys.path.insert(0, str(ROOT / "scripts"))             # smollm2 (builds the float folder from the GGUF)


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
    parser.add_argument("--text", type=Path, default=ROOT / "benchmarks" / "data" / "heldout.txt")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--work", type=Path, default=None, help="where the quantised folders go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.model is None:
        from smollm2 import build_smollm2

        args.model = build_smollm2()
    from quantized_models import FakeQuantReference

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(args.text.read_text(), add_special_tokens=False)["input_ids"]
    print(f"machine: {machine.cpu_model()}; torch threads {torch.get_num_threads()}")
    print(f"held-out text: {args.text.name}, {len(ids)} tokens, windows of {args.window}")
    rows = [("float32", "-", perplexity(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(),
                                        ids, args.window), 0.0)]
    work = args.work or Path(tempfile.mkdtemp(prefix="dlinfer-quality-"))
    labels = {"rtn": "RTN 4-bit (W4A16)", "awq": "AWQ 4-bit (W4A16)", "awq-noclip": "AWQ 4-bit, no clipping",
              "smooth_quant": "SmoothQuant W8A8"}
    for run in args.runs.split(","):
        method, _, group = run.partition(":")
        group_size = int(group or 64)
        dst = work / (f"{args.model.name}-{method}" + (f"-g{group_size}" if method != "smooth_quant" else ""))
        start = time.perf_counter()
        if not dst.exists():
            quantize(args.model, dst, method.replace("-noclip", ""), group_size=group_size, log=lambda line: None,
                     clip=not method.endswith("-noclip"))
        seconds = time.perf_counter() - start
        ppl = perplexity(FakeQuantReference(dst).model, ids, args.window)
        rows.append((labels[method], f"g{group_size}" if method != "smooth_quant" else "per channel / per token",
                     ppl, seconds))
        print(f"{labels[method]} {rows[-1][1]}: perplexity {ppl:.3f}, quantised in {seconds:.0f} s", flush=True)
    base = rows[0][2]
    print("\n| model | grouping | perplexity | vs float32 | quantise time (s) |\n|---|---|---|---|---|")
    for label, grouping, ppl, seconds in rows:
        print(f"| {label} | {grouping} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
