"""The GPU check: every step of issue 31 in one run of at most ~9 minutes, each step in a process
of its own with a time budget, so one failure or hang costs that step, not the lease.

    python scripts/gpu_check.py --out DIR [--dry-run] [--steps a,b] [--deadline 510] [--conformance-checks P]

Run it through scripts/gpu_check.sh, which prepares the Python path (the carried wheels and
LMDeploy's sources on the GPU machine). Steps, in order (name: what, budget on the GPU):
  env          versions, the GPU's name, SMs and memory                                      20 s
  big_cache    fill / decode / prefill over a cache past 2**31 elements (gpu_big_cache.py)    60 s
  conformance  `python -m dlinfer conformance --vendor triton`, bfloat16, full shapes         170 s
  ops          per-op times vs the torch vendor and LMDeploy's kernels (bench_triton_ops.py)   90 s
  attention    paged decode / prefill attention times (bench_triton_attention.py)             50 s
  tiles        alternatives: tiles of W4A16, W8A8, prefill attention, fused_moe; dynamic_quant's
               quotient form; prefill attention's unmasked walk (gpu_tile_sweep.py)            90 s
  engine       dlinfer_cuda vs LMDeploy's CUDA backend: tokens, tok/s (gpu_engine.py)        200 s
  conformance_fp16  the same suite in float16, the ops with fp16 paths of their own (FP16_OPS) 100 s
A step gets min(its budget, the time left before --deadline, counted from the shell script's
start); one with under 15 s left is skipped. The dry run doubles every budget and the default
deadline: it proves the steps run, and a slow or busy CPU is no finding. A step past its budget is
killed with its whole process group (an engine's workers too). gpu_check.json and gpu_check.md
are rewritten after every step, so a run cut off by the device tool's limit still brings back what
was done.

Results in --out (at most 8 files, as the device tool brings back):
  gpu_check.md    the summary table and each step's result (what docs/gpu.md is written from);
  gpu_check.json  everything: each step's command, exit status, time and JSON output;
  gpu_check.log   every step's output;
  conformance-bfloat16.md, conformance-float16.md   the conformance reports.
--dry-run runs every step on the CPU under TRITON_INTERPRET=1 at tiny shapes (<= 3 minutes; the
engine step first and beside the others, as nothing is timed), so the script is known to work before a
GPU minute is spent; tests/test_gpu_check.py runs it in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_timing import run_limited  # noqa: E402

PY = sys.executable
# The ops the float16 conformance covers (bfloat16 covers all of them): those whose kernels take a
# path of their own in fp16, within the step's budget.
FP16_OPS = ("rms_norm,silu_and_mul,fill_kv_cache,prefill_attention,paged_decode_attention,linear_w8a8,"
            "weight_quant_matmul")
DRY_FP16_OPS = "rms_norm,silu_and_mul,fill_kv_cache,paged_decode_attention,linear_w8a8"


def steps(out: Path, work: Path, dry: bool, tokenizer: str | None, checks: str | None = None) -> list:
    """(name, argv, budget seconds, JSON file the step writes or None). checks: check-id patterns
    for both conformance steps (a targeted rerun)."""
    bench = REPO / "benchmarks"
    dry_flag = ["--dry-run"] if dry else []
    conf = []
    for dtype, budget in (("bfloat16", 170), ("float16", 100)):
        argv = [PY, "-m", "dlinfer", "conformance", "--vendor", "triton", "--dtypes", dtype,
                "--report", str(work / f"conformance-{dtype}.json"), "--markdown", str(out / f"conformance-{dtype}.md")]
        argv += ["--small", "--device", "cpu"] if dry else ["--device", "cuda"]
        if dtype == "float16":
            argv += ["--ops", DRY_FP16_OPS if dry else FP16_OPS]
        if checks:
            argv += ["--checks", checks]
        conf.append((argv, budget, work / f"conformance-{dtype}.json"))
    # SmolLM2's shapes on the GPU (the tiny Llama adds nothing there but time); the dry run's
    # engine takes the tiny one whatever is asked.
    engine = [PY, str(bench / "gpu_engine.py"), "--json", str(work / "engine.json"), "--work", str(work),
              "--new-tokens", "32", "--side-timeout", "120", "--models", "smollm2"] + dry_flag
    if tokenizer:
        engine += ["--tokenizer", tokenizer]
    return [
        ("env", [PY, __file__, "--env", str(work / "env.json")], 20, work / "env.json"),
        ("big_cache", [PY, str(bench / "gpu_big_cache.py"), "--json", str(work / "big_cache.json")] + dry_flag, 60,
         work / "big_cache.json"),
        ("conformance", *conf[0]),
        ("ops", [PY, str(bench / "bench_triton_ops.py"), "--reps", "20", "--json", str(work / "ops.json")] + dry_flag,
         90, work / "ops.json"),
        ("attention", [PY, str(bench / "bench_triton_attention.py"), "--iters", "20", "--json",
                       str(work / "attention.json")] + dry_flag, 50, work / "attention.json"),
        ("tiles", [PY, str(bench / "gpu_tile_sweep.py"), "--reps", "10", "--json", str(work / "tiles.json")]
         + dry_flag, 90, work / "tiles.json"),
        ("engine", engine, 200, work / "engine.json"),
        ("conformance_fp16", *conf[1]),
    ]


def env_step(path: str) -> int:
    """Versions and the device, as JSON (no vendor is loaded: the cpu vendor would compile)."""
    import importlib.metadata as md

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    for dist in ("triton", "lmdeploy", "transformers", "tokenizers", "dlinfer"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    import importlib.util

    info["lmdeploy_from"] = str(importlib.util.find_spec("lmdeploy").origin)  # the carried copy, not a wheel
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}")
        try:
            query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
            info["nvidia_smi"] = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True,
                                                text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
    else:
        info["gpu"] = None
    Path(path).write_text(json.dumps(info, indent=1))
    print(json.dumps(info))
    return 0


def run_step(name, argv, budget, log) -> dict:
    """Runs one step, its output appended to the open log; returns its status, time and argv, and
    the conformance's failed checks as it printed them (what a step killed at its budget leaves)."""
    t0 = time.perf_counter()
    log.write(f"\n===== {name}: {' '.join(argv)} (budget {budget:.0f} s)\n")
    log.flush()
    begin = log.tell()
    rc, _, _ = run_limited(argv, budget, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    status = f"timed out after {budget:.0f} s" if rc is None else "ok" if rc == 0 else f"failed (exit {rc})"
    seconds = time.perf_counter() - t0
    log.flush()
    with open(log.name, errors="replace") as f:
        f.seek(begin)
        failed = [line.strip()[len("FAILED "):] for line in f if line.startswith("  FAILED ")]
    log.write(f"===== {name}: {status} in {seconds:.1f} s\n")
    log.flush()
    result = {"status": status, "seconds": round(seconds, 1), "argv": argv}
    if failed:
        result["failed_checks"] = failed
    return result


def summary(results: dict, dry: bool) -> str:
    """The Markdown summary: one line per step, then what each step found."""
    env = results.get("env", {}).get("output") or {}
    lines = [f"# GPU check{' (DRY RUN: CPU, interpreter, tiny shapes; no timings)' if dry else ''}", "",
             f"Device: {env.get('gpu') or 'cpu'}; torch {env.get('torch')}, Triton {env.get('triton')}, "
             f"LMDeploy {env.get('lmdeploy')}, transformers {env.get('transformers')}, Python {env.get('python')}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| step | status | seconds |", "|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '-')} |")
    for name in ("conformance", "conformance_fp16"):
        report = (results.get(name) or {}).get("output")
        if isinstance(report, dict) and "cases" in report:
            s = report["summary"]
            lines += ["", f"## {name}: {report['result']} ({s['passed']} passed, {s['failed']} failed, "
                          f"{s['skipped']} skipped, {report.get('seconds', 0):.0f} s)"]
            lines += [f"- {c['id']}: {c['status']} {str(c.get('error', ''))[:240]}"
                      for c in report["cases"] if c["status"] == "failed"][:40]
        elif (results.get(name) or {}).get("failed_checks"):  # no report (cut off): what the log named
            failed = results[name]["failed_checks"]
            lines += ["", f"## {name}: {results[name]['status']}; {len(failed)} checks failed before that", ""]
            lines += [f"- {line[:300]}" for line in failed[:40]]
    big = (results.get("big_cache") or {}).get("output")
    if big:
        lines += ["", "## big_cache", "", "```", json.dumps(big), "```"]
    lines += ops_table((results.get("ops") or {}).get("output"))
    lines += attention_table((results.get("attention") or {}).get("output"))
    lines += tiles_table((results.get("tiles") or {}).get("output"))
    lines += engine_lines((results.get("engine") or {}).get("output"))
    return "\n".join(lines) + "\n"


def _f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def _table(heading: str, columns: list, rows: list, keys, cells, error_word: str = "ERROR") -> list:
    """A Markdown table of a step's rows: keys(row) are its leading cells, cells(row) the rest; a
    row holding an "error" gets its keys, then the error in one cell, then empty cells."""
    lines = ["", heading, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lead = keys(r)
        if "error" in r:
            lines.append("| " + " | ".join([*lead, f"{error_word}: {r['error'][:150]}"]) + " |"
                         + " |" * (len(columns) - len(lead) - 1))
        else:
            lines.append("| " + " | ".join([*lead, *cells(r)]) + " |")
    return lines


def ops_table(out) -> list:
    if not out or not out.get("rows"):
        return []
    heading = (f"## ops ({out.get('dtype')}; median of {out.get('reps')}; LMDeploy kernels: "
               f"{'yes' if not out.get('lmdeploy_unavailable') else out['lmdeploy_unavailable']})")
    columns = ["op", "case", "triton us", "torch us", "LMDeploy us", "LMDeploy / triton time", "GB/s", "% peak BW",
               "TFLOP/s", "% peak FLOP", "host us: triton / LMDeploy", "triton err vs torch", "LMDeploy err vs torch"]

    def cells(r):
        vs = f"{r['vs_lmdeploy']:.2f}" if r.get("vs_lmdeploy") else r.get("lmdeploy_error", "-")[:80]
        host = f"{_f(r.get('triton_host_us'), '.1f')} / {_f(r.get('lmdeploy_host_us'), '.1f')}"
        return [_f(r["triton_us"], ".1f"), _f(r["torch_us"], ".1f"), _f(r.get("lmdeploy_us"), ".1f"), vs,
                _f(r["gb_per_s"], ".0f"), str(r["bw_share"]), _f(r.get("tflops"), ".1f"),
                str(r.get("flops_share", "-")), host, str(r["err"]), str(r.get("lmdeploy_err", "-"))]

    return _table(heading, columns, out["rows"], lambda r: [r["op"], r["case"]], cells)


def attention_table(out) -> list:
    if not out or not out.get("rows"):
        return []
    columns = ["config", "impl", "ms", "host ms", "GB/s", "% peak BW", "TFLOP/s", "max abs diff vs triton"]
    return _table(f"## attention ({out.get('dtype')})", columns, out["rows"], lambda r: [r["config"], r["impl"]],
                  lambda r: [_f(r["ms"], ".3f"), _f(r.get("host_ms"), ".3f"), _f(r["gb_per_s"], ".0f"),
                             _f(r.get("bw_share_pct"), ".1f"),
                             _f(r.get("tflops"), ".1f"), _f(r["max_abs_diff_vs_triton"], ".2e")],
                  error_word="skipped")


def tiles_table(out) -> list:
    if not out or not out.get("rows"):
        return []
    columns = ["case", "tile function", "launcher's own us", "best alternative", "its us", "speedup"]

    def cells(r):
        best = r.get("best") or {}
        return [_f(r.get("own_us"), ".1f"), str(best.get("tiles", "-")), _f(best.get("us"), ".1f"),
                _f(r.get("speedup"), ".2f")]

    return _table(f"## tiles ({out.get('dtype')}; median of {out.get('reps')})", columns, out["rows"],
                  lambda r: [r["case"], "-" if "error" in r else f"`{r['function']}`"], cells)


def engine_lines(out) -> list:
    if not out:
        return []
    lines = ["", f"## engine ({out.get('dtype')}, {out.get('new_tokens')} new tokens, batches {out.get('batches')})"]
    for name, m in out.get("models", {}).items():
        lines += ["", f"### {name}", ""]
        for side in ("dlinfer_cuda", "native", "native_cudagraph"):
            if side not in m:
                continue
            r = m[side]
            mode = "eager" if r.get("eager") else "CUDA graphs"
            if "error" in r:
                lines.append(f"- {side}: ERROR {r['error'][:600]}")
            else:
                lines.append(f"- {side} ({mode}): load {_f(r.get('load_s'), '.1f')} s, decode tok/s "
                             + ", ".join(f"batch {b}: {_f(v, '.1f')}" for b, v in r.get("decode_tok_s", {}).items()))
        toks = m.get("tokens")
        if toks:
            same = sum(t["equal"] for t in toks)
            lines.append(f"- greedy tokens equal on {same}/{len(toks)} prompts")
            for t in toks:
                if not t["equal"]:
                    lines.append(f"  - prompt {t['prompt']}: first divergence at token {t['first_divergence']}; HF "
                                 f"top-2 margin {_f(t.get('top2_margin'), '.4f')}, chosen tokens' gap "
                                 f"{_f(t.get('chosen_gap'), '.4f')}, bf16 ulp {_f(t.get('bf16_ulp_at_top1'), '.4f')}"
                                 + (f" ({t['explain_error']})" if "explain_error" in t else ""))
        for side in ("dlinfer_cuda", "native"):
            prof = (m.get(side) or {}).get("host_profile")
            if prof:
                lines.append(f"- {side} host time at batch {prof['batch']} ({prof['wall_ms_per_step']:.1f} ms a step): "
                             + "; ".join(f"{r['op']} {r['self_cpu_ms_per_step']:.2f} ms x{r['calls_per_step']:.0f}"
                                         for r in prof["top_self_cpu"][:10]))
        a = m.get("dlinfer_cuda", {}).get("decode_tok_s", {})
        for other in ("native", "native_cudagraph"):
            b = m.get(other, {}).get("decode_tok_s", {})
            ratios = [f"batch {k}: {a[k] / b[k]:.2f}x" for k in a if k in b and a[k] and b[k]]
            if ratios:
                lines.append(f"- dlinfer_cuda / {other} decode tok/s: " + ", ".join(ratios))
    return lines


def write_results(out: Path, results: dict, dry: bool) -> None:
    (out / "gpu_check.json").write_text(json.dumps({"dry_run": dry, "steps": results}, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(summary(results, dry))


def ordered(results: dict, plan: list) -> dict:
    """`results` in the plan's order of steps."""
    return {name: results[name] for name, *_ in plan if name in results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="results folder (default $OUT, else ./gpu_check_out)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--steps", help="comma-separated step names (default: all)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole check, counted from GPU_CHECK_T0 (the shell script's start, in "
                         "epoch seconds) when set, else from now (default 510; the dry run's 1020)")
    ap.add_argument("--tokenizer", help="SmolLM2's tokenizer folder for the engine step")
    ap.add_argument("--conformance-checks", metavar="PATTERNS",
                    help="check-id patterns for the conformance steps (comma-separated, '*' any text): a rerun "
                         "of what failed, e.g. '*mla*,weight_quant*'")
    ap.add_argument("--env", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.env:
        return env_step(args.env)
    out = Path(args.out or os.environ.get("OUT") or REPO / "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    plan = steps(out, work, args.dry_run, args.tokenizer, args.conformance_checks)
    known = [s[0] for s in plan]
    wanted = args.steps.split(",") if args.steps else known
    unknown = set(wanted) - set(known)
    if unknown:
        ap.error(f"unknown steps {sorted(unknown)}; known: {', '.join(known)}")
    stretch = 2 if args.dry_run else 1  # the dry run's budgets (module docstring)
    if args.deadline is None:
        args.deadline = 510 * stretch
    started = float(os.environ.get("GPU_CHECK_T0") or time.time())
    results = {}
    beside = None  # the dry run's engine step: (thread, its log), run beside the others

    def run(name, step_argv, budget, produced, log):
        # The result is built whole, then published: the dry run's engine thread must not change a
        # dict the main thread may be writing out, and an error in it must not vanish with it.
        try:
            result = run_step(name, step_argv, budget, log)
            if produced and produced.is_file():
                try:
                    result["output"] = json.loads(produced.read_text())
                except (json.JSONDecodeError, OSError, UnicodeDecodeError) as exc:
                    result["output"] = f"unreadable JSON: {exc}"
        except Exception as exc:
            result = {"status": f"failed ({type(exc).__name__}: {exc})", "seconds": None, "argv": step_argv}
        results[name] = result
        print(f"[gpu_check] {name}: {result['status']} ({result['seconds']} s)", file=sys.stderr, flush=True)

    # The dry run times nothing: its engine step (about half of it, mostly one core's Python) starts
    # first and runs beside the others, into a log of its own appended at the end.
    order = sorted(plan, key=lambda step: step[0] != "engine") if args.dry_run else plan
    with open(out / "gpu_check.log", "w") as log:
        for name, step_argv, budget, produced in order:
            if name not in wanted:
                continue
            left = args.deadline - (time.time() - started)
            if left < 15:
                results[name] = {"status": f"skipped: {left:.0f} s left of the {args.deadline:.0f} s deadline"}
                continue
            budget = min(budget * stretch, left)
            if name == "engine":  # it shares its budget among its sides and reports after each
                step_argv = [*step_argv, "--budget", f"{budget - 10:.0f}"]
            print(f"[gpu_check] {name} (budget {budget:.0f} s)", file=sys.stderr, flush=True)
            if name == "engine" and args.dry_run:
                own = open(work / "engine.log", "w+")
                beside = (threading.Thread(target=run, args=(name, step_argv, budget, produced, own)), own)
                beside[0].start()
                continue
            run(name, step_argv, budget, produced, log)
            # after every step: a cut-off run keeps what was done
            write_results(out, ordered(results, plan), args.dry_run)
        if beside is not None:
            thread, own = beside
            thread.join()
            own.seek(0)
            log.write(own.read())
            own.close()
    results = ordered(results, plan)
    write_results(out, results, args.dry_run)
    print(f"[gpu_check] results in {out}: gpu_check.md, gpu_check.json, gpu_check.log", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
