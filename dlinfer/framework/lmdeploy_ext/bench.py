"""`python -m dlinfer bench MODEL [options]`: decode speed and time to first token of a model
through LMDeploy on a dlinfer device type, in the spirit of llama.cpp's `llama-bench`.

For each mode (`--mode eager,graph`) and dtype (`--dtype`), one engine in this process, then:
- decode tokens/s at each batch size of `--batch` (default 1 and 8): chat-templated prompts,
  exactly `--new-tokens` greedy tokens each; the method of benchmarks/e2e_cpu.py, with the same
  code (dlinfer/tools/decode_timing.py): B * (N - 1) / (T(N) - T(1)), each T the best of
  `--repeats`;
- time to first token at each prompt length of `--prompt-lengths` (default 32 and 512 tokens);
- at batch 1, the weights a decode step reads (GB), the rate it reads them at, and its share of
  the read-bandwidth probe (the cpu vendor's, read 5 times before any engine loads: `Probe`;
  where the cpu vendor does not load, the table says so).
One progress line per step on stderr, one Markdown table at the end on stdout. MODEL: any local
folder the engine runs (HF float, AWQ, SmoothQuant); a folder that is not one, an unknown device
or a setting the device refuses is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict

from dlinfer.framework.lmdeploy_options import check_bench_options

PROG = "python -m dlinfer bench"  # its options: dlinfer/__main__.py (parsing them patches nothing)


class Probe:
    """The cpu vendor's read-bandwidth probe, explored and read before any engine loads, then freed:
    interleaved with the engine's timings in this process it slowed them (SmolLM2, graph bf16, batch
    1: 42 against 75 tokens/s without it, the cause not established), where benchmarks/e2e_cpu.py
    reads it in a process of its own between the sides' timings. `median` is None where it cannot
    run, and `summary` says why."""

    READINGS = 5

    def __init__(self, enabled: bool, log):
        self.median, self.summary = None, "no read-bandwidth probe (--no-probe)"
        if not enabled:
            return
        try:
            from dlinfer.vendor.cpu import read_probe

            log("[bench] exploring the read-bandwidth probe (a few seconds), before any engine loads ...")
            probe = read_probe.ReadProbe()
            self.summary = read_probe.summary(probe.explore(rounds=2))
            probe.keep_best()
            self.median = statistics.median(probe.measure() for _ in range(self.READINGS))
            probe.release()
        except Exception as exc:  # noqa: BLE001 (no compiler, no cpu vendor: the table says why)
            self.summary = f"no read-bandwidth probe available here ({type(exc).__name__}: {exc})"


def measure(pipe, args, probe: Probe, log, label: str) -> Dict:
    """One engine's row: {batch: tok/s}, {prompt length: ttft s}, step bytes, probe at batch 1."""
    from dlinfer.tools import decode_timing as timing  # torch: imported once the options are checked

    tokenizer = pipe.async_engine.tokenizer.model.model
    prompts = timing.chat_prompts(tokenizer, max(args.batch))
    run = timing.generator(pipe)
    for batch in args.batch:  # warm-up: allocators, lazy inits, every batch size once
        run(batch, args.new_tokens, prompts=prompts)
    best: Dict[tuple, float] = {}
    for r in range(args.repeats):
        for batch in args.batch:
            for n in (args.new_tokens, 1):
                start = time.perf_counter()
                run(batch, n, prompts=prompts)
                best[(batch, n)] = min(best.get((batch, n), float("inf")), time.perf_counter() - start)
        rates = {b: timing.decode_rate(b, args.new_tokens, best[(b, args.new_tokens)], best[(b, 1)])
                 for b in args.batch}
        log(f"[bench] {label}: round {r + 1}/{args.repeats}: decode tokens/s "
            + ", ".join(f"batch {b} {rate:.1f}" for b, rate in rates.items()))
    ttft = {}
    for length in args.prompt_lengths:
        ids = timing.prompt_ids(tokenizer, length, prompts)
        run(1, 1, ids=ids)  # warm-up of this prompt length
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run(1, 1, ids=ids)
            times.append(time.perf_counter() - start)
        ttft[length] = min(times)
        log(f"[bench] {label}: first token of a {length}-token prompt after {ttft[length]:.3f} s")
    return dict(rates=rates, ttft=ttft, step_bytes=timing.step_bytes(pipe), probe=probe.median)


def render(rows: Dict[str, Dict], args, probe: Probe, model: str) -> str:
    import os
    import platform

    import torch

    head = ["mode, dtype", *(f"batch {b} tok/s" for b in args.batch),
            *(f"TTFT {n} tok (s)" for n in args.prompt_lengths), "GB a step", "weights GB/s (batch 1)",
            "share of the probe"]
    lines = [f"## {PROG} {model}",
             f"{args.new_tokens} new tokens, greedy, best of {args.repeats}; {os.cpu_count()} CPUs "
             f"({platform.processor() or platform.machine()}), torch {torch.__version__} "
             f"({torch.get_num_threads()} threads); probe (before the engines): {probe.summary}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, row in rows.items():
        gb = row["step_bytes"] / 1e9 if row["step_bytes"] else None  # None: the ranks' own processes (tp > 1)
        rate = row["rates"].get(1)
        streamed = gb * rate if gb and rate and rate == rate else None
        share = f"{streamed / (row['probe'] / 1e9):.2f}" if streamed and row["probe"] else "-"
        cells = [label, *(f"{row['rates'][b]:.1f}" for b in args.batch),
                 *(f"{row['ttft'][n]:.3f}" for n in args.prompt_lengths),
                 f"{gb:.4g}" if gb else "-", f"{streamed:.3g}" if streamed else "-", share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace, out=None, err=None) -> int:
    """Measure, print the table: 0; 2 (one line on stderr) for a MODEL the engine cannot load, an
    unknown device, bad option values or a setting the device refuses."""
    out, err = out or sys.stdout, err or sys.stderr

    def log(msg: str) -> None:
        err.write(msg + "\n")
        err.flush()

    try:
        modes, dtypes = check_bench_options(args)
    except ValueError as exc:
        log(f"{PROG}: error: {exc}")
        return 2
    import dlinfer.framework.lmdeploy_ext  # noqa: F401  (adds dlinfer's device types to LMDeploy)
    from dlinfer.framework.lmdeploy_ext.serve import check_model_here

    try:
        check_model_here(argparse.Namespace(model_path=args.model, device=args.device))
        configs = {f"{mode}, {dtype}": _engine_config(args, mode, dtype) for mode in modes for dtype in dtypes}
    except ValueError as exc:
        log(f"{PROG}: error: {exc}")
        return 2
    from lmdeploy import pipeline

    probe = Probe(not args.no_probe, log)
    rows = {}
    for label, config in configs.items():
        log(f"[bench] {label}: loading {args.model} ...")
        start = time.perf_counter()
        try:
            pipe = pipeline(args.model, backend_config=config, log_level="ERROR")
        except (ValueError, RuntimeError, OSError) as exc:  # a setting or model refused, a vendor error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            log(f"{PROG}: error: {label}: {type(exc).__name__}: {first}")
            return 2
        try:
            log(f"[bench] {label}: ready in {time.perf_counter() - start:.1f} s")
            rows[label] = measure(pipe, args, probe, log, label)
        except RuntimeError as exc:  # the engine did not give the tokens asked for
            log(f"{PROG}: error: {label}: {exc}")
            return 1
        finally:
            pipe.close()
    out.write(render(rows, args, probe, args.model))
    out.flush()
    return 0


def _engine_config(args, mode: str, dtype: str):
    from lmdeploy import PytorchEngineConfig

    longest = max(args.prompt_lengths) + args.new_tokens + 64
    config = dict(device_type=args.device, dtype=dtype, eager_mode=mode == "eager", tp=args.tp,
                  max_batch_size=max(args.batch), session_len=max(longest, 2048), enable_metrics=False)
    return PytorchEngineConfig(**config)
