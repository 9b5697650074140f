"""Decode speed of LMDeploy on device_type="cpu": eager mode against graph mode (dlinfer backend).

    python tests/graph/bench_graph_mode.py                       # SmolLM2-135M, batch 1 and 8
    python tests/graph/bench_graph_mode.py --batch 1 --tokens 64 --repeat 5 --model <hf folder>

Modes: eager (`eager_mode=True`), graph (`eager_mode=False`, the runner's default compiler:
"direct"), graph+inductor (the same with DLINFER_GRAPH_COMPILER=inductor). For each batch size,
one pipeline per mode (float32, greedy, ignore_eos, max_batch_size = the batch) is built, then
the modes take turns, `--repeat` rounds, so that all see the same machine load. Decode tokens/s
= B * tokens / (time(1 + tokens new tokens) - time(1 new token)): prefill and the first token
are not counted. Also reported: the median wall time of the model call of a decode step (the
graph runner's __call__, padding included), build + warm-up time (compiles included), graphs
compiled, and whether each mode produced eager's tokens. Not collected by pytest.
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


def _instrument_forwards():
    """Record the wall time of every decode forward (the model call alone) on its runner."""
    from lmdeploy.pytorch.backends.graph_runner import GraphRunner

    from dlinfer.framework.lmdeploy_ext.graph_runner import DlinferGraphRunner

    for cls in (GraphRunner, DlinferGraphRunner):
        call = cls.__dict__["__call__"]

        def timed(self, _call=call, **kwargs):
            start = time.perf_counter()
            out = _call(self, **kwargs)
            if kwargs["attn_metadata"].is_decoding and hasattr(self, "bench_times"):
                self.bench_times.append(time.perf_counter() - start)
            return out

        cls.__call__ = timed


def _runner(pipe):
    return pipe.async_engine.engine.executor.model_agent.patched_model


# mode -> (eager_mode, DLINFER_GRAPH_COMPILER)
MODES = {"eager": (True, None), "graph": (False, None), "graph+inductor": (False, "inductor")}


def build(model_dir: Path, batch: int, mode: str):
    import dlinfer.framework.lmdeploy_ext  # noqa: F401
    from lmdeploy import PytorchEngineConfig, pipeline

    eager, compiler = MODES[mode]
    config = PytorchEngineConfig(device_type="cpu", dtype="float32", eager_mode=eager, max_batch_size=batch,
                                 block_size=16, num_gpu_blocks=256)
    saved = os.environ.pop("DLINFER_GRAPH_COMPILER", None)
    if compiler:
        os.environ["DLINFER_GRAPH_COMPILER"] = compiler  # read when the graph runner is built
    try:
        start = time.perf_counter()
        pipe = pipeline(str(model_dir), backend_config=config, log_level="ERROR")
        return pipe, time.perf_counter() - start
    finally:
        os.environ.pop("DLINFER_GRAPH_COMPILER", None)
        if saved is not None:
            os.environ["DLINFER_GRAPH_COMPILER"] = saved


def measure(pipe, prompts, tokens):
    """(decode tokens/s, tokens) of one greedy generation of `tokens` new tokens per prompt."""
    t1, _ = _timed(pipe, prompts, 1)
    _runner(pipe).bench_times = []
    tn, ids = _timed(pipe, prompts, 1 + tokens)
    forward = statistics.median(_runner(pipe).bench_times)
    return len(prompts) * tokens / max(tn - t1, 1e-9), forward, ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    if args.model is None:
        from smollm2 import build_smollm2

        model_dir = build_smollm2(log=lambda _: None)
    else:
        model_dir = Path(args.model)
    import torch

    print(f"# {model_dir.name}, float32, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    _instrument_forwards()
    print("| batch | mode | decode tok/s (median) | min - max | model forward ms (median) | build + warm-up s "
          "| graphs compiled | same tokens as eager |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        pipes = {mode: build(model_dir, batch, mode) for mode in args.modes}
        rates, forwards, ids = {m: [] for m in pipes}, {m: [] for m in pipes}, {}
        try:
            for pipe, _ in pipes.values():
                _timed(pipe, prompts, 4)  # first request: allocator, thread pools
            for _ in range(args.repeat):  # interleaved, so every mode sees the same machine load
                for mode, (pipe, _) in pipes.items():
                    rate, forward, ids[mode] = measure(pipe, prompts, args.tokens)
                    rates[mode].append(rate)
                    forwards[mode].append(forward)
            compiles = {m: getattr(_runner(p), "compiles", 0) for m, (p, _) in pipes.items()}
        finally:
            for pipe, _ in pipes.values():
                pipe.close()
        reference = ids[args.modes[0]]
        for mode in args.modes:
            r = rates[mode]
            print(f"| {batch} | {mode} | {statistics.median(r):.1f} | {min(r):.1f} - {max(r):.1f} | "
                  f"{1e3 * statistics.median(forwards[mode]):.1f} | {pipes[mode][1]:.0f} | {compiles[mode]} | "
                  f"{'yes' if ids[mode] == reference else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
