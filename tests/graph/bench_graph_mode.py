"""Decode speed of LMDeploy on device_type="cpu": eager mode against graph mode (dlinfer backend).

    python tests/graph/bench_graph_mode.py                       # SmolLM2-135M, batch 1 and 8
    python tests/graph/bench_graph_mode.py --batch 1 --tokens 64 --repeat 5 --model <hf folder>

For each batch size and mode, one pipeline (float32, greedy, ignore_eos) generates `--tokens` new
tokens for B prompts `--repeat` times; decode time = time(1 + tokens) - time(1 new token), so
prefill and the first token are not counted. Reported: decode tokens/s over all sequences
(median and best of the repeats), graph compiles, and whether both modes produced the same
tokens. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "lmdeploy"))
sys.path.insert(0, str(REPO / "scripts"))

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain what a key-value cache is in one paragraph.",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to German: good morning, how are you?",
]


def _timed(pipe, prompts, new_tokens):
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, ignore_eos=True)
    start = time.perf_counter()
    out = pipe(prompts, gen_config=gen, do_preprocess=False)
    return time.perf_counter() - start, [list(o.token_ids) for o in out]


def run_mode(model_dir: Path, batch: int, eager: bool, tokens: int, repeat: int):
    import dlinfer.framework.lmdeploy_ext  # noqa: F401
    from lmdeploy import PytorchEngineConfig, pipeline

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    config = PytorchEngineConfig(device_type="cpu", dtype="float32", eager_mode=eager, max_batch_size=batch,
                                 block_size=16, num_gpu_blocks=256)
    start = time.perf_counter()
    pipe = pipeline(str(model_dir), backend_config=config, log_level="ERROR")
    build_s = time.perf_counter() - start
    try:
        _timed(pipe, prompts, 4)  # first request: allocator, thread pools
        rates, ids = [], None
        for _ in range(repeat):
            t1, _ = _timed(pipe, prompts, 1)
            tn, ids = _timed(pipe, prompts, 1 + tokens)
            rates.append(batch * tokens / max(tn - t1, 1e-9))
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        compiles = getattr(runner, "compiles", 0)
    finally:
        pipe.close()
    return dict(build_s=build_s, rates=rates, ids=ids, compiles=compiles)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.model is None:
        from smollm2 import build_smollm2

        model_dir = build_smollm2(log=lambda _: None)
    else:
        model_dir = Path(args.model)
    import torch

    print(f"# {model_dir.name}, float32, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| batch | mode | decode tok/s (median) | best | build+warm-up s | graphs compiled | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        results = {}
        for eager in (True, False):
            results[eager] = run_mode(model_dir, batch, eager, args.tokens, args.repeat)
        same = results[True]["ids"] == results[False]["ids"]
        for eager in (True, False):
            r = results[eager]
            print(f"| {batch} | {'eager' if eager else 'graph'} | {statistics.median(r['rates']):.1f} | "
                  f"{max(r['rates']):.1f} | {r['build_s']:.0f} | {r['compiles']} | {'yes' if same else 'NO'} |",
                  flush=True)


if __name__ == "__main__":
    main()
