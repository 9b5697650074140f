"""LMDeploy on device_type="dlinfer_cuda" (dlinfer's triton vendor) against LMDeploy's own CUDA
backend: greedy tokens and decode speed on one GPU (step (c) of scripts/gpu_check.sh).

    python benchmarks/gpu_engine.py [--models tiny,smollm2] [--batches 1,16,64] [--json FILE]
    TRITON_INTERPRET=1 python benchmarks/gpu_engine.py --dry-run      # CPU, tiny, a few tokens

Models (built here, offline): `tiny` is the test suite's tiny Llama (tests/support/tiny_models.py);
`smollm2` is a random-weight checkpoint at SmolLM2-135M's shapes with its tokenizer
(benchmarks/make_checkpoint.py smollm2-135m; the tokenizer from --tokenizer, which
scripts/gpu_check.sh points at the carried .gpu/tokenizer).

Sides: dlinfer_cuda (eager: its graph runner is LMDeploy's plain one), LMDeploy's CUDA backend in
eager mode (the like-for-like row) and with its CUDA graphs (what LMDeploy users run; the
SmolLM2-shaped model only). Each side runs in a process of its own (the native side never imports
dlinfer's adaptor, which patches LMDeploy), in the time left of --budget, and writes JSON:
- greedy tokens of 8 chat prompts (--prompts; the dry run: 2; do_preprocess=False on the
  template-rendered prompts, the end of sequence banned), all submitted at once;
- decode tokens/s at each batch size, as dlinfer/tools/decode_timing.py defines it (B (N - 1) /
  (T(N) - T(1)), best of --repeats).
The parent compares the tokens prompt by prompt. Where they differ it explains the first
divergence with HF transformers in the same dtype on the same device: the logits' top-2 margin at
that position along the common prefix, and how far apart the two chosen tokens' logits are. Random
weights give nearly flat logits, so a tie broken by bf16 rounding shows as a margin of a few bf16
ulps; a real bug shows as a large one.

Dry run: the two sides are device_type="cpu" on the triton vendor (interpreted) and on the torch
vendor; it proves the script, its processes and its comparison work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
from gpu_timing import run_limited  # noqa: E402

# (side name, LMDeploy device type, dlinfer vendor, eager). dlinfer_cuda runs eager: its graph
# runner is LMDeploy's plain GraphRunner (no CUDA graphs, dlinfer's graph mode is "cpu" only), so
# the native backend runs eager too for a like-for-like row, then with its CUDA graphs.
GPU_SIDES = (("dlinfer_cuda", "dlinfer_cuda", None, True), ("native", "cuda", None, True),
             ("native_cudagraph", "cuda", None, False))
DRY_SIDES = (("dlinfer_cuda", "cpu", "triton", True), ("native", "cpu", "torch", True))
PROMPTS = 8  # the greedy-token comparison's prompts (--prompts; the dry run takes 2)


def build_model(name: str, tokenizer: str | None) -> Path:
    if name == "tiny":
        from support.tiny_models import tiny_model

        return tiny_model("llama")
    if name == "smollm2":
        import make_checkpoint

        return make_checkpoint.build("smollm2-135m", "bfloat16", log=lambda m: print(m, file=sys.stderr),
                                     tokenizer=Path(tokenizer) if tokenizer else None)
    raise SystemExit(f"unknown model {name!r}: tiny or smollm2")


# ---------------------------------------------------------------- one side, in its own process
def child(args) -> int:
    side = json.loads(args.child)
    if side["vendor"]:
        os.environ["DLINFER_VENDOR"] = side["vendor"]
    from lmdeploy import PytorchEngineConfig, pipeline

    if side["device_type"] != "cuda":
        import dlinfer.framework.lmdeploy_ext  # noqa: F401  (the native side never imports it)
    from dlinfer.tools.decode_timing import chat_prompts, decode_rate, generator

    batches = [int(b) for b in args.batches.split(",")]
    out = {"side": side, "eager": args.eager, "started": time.time()}
    cfg = dict(device_type=side["device_type"], dtype=args.dtype, eager_mode=args.eager,
               max_batch_size=max(max(batches), args.prompts), session_len=4096)
    if side["device_type"] == "cpu":
        cfg.update(block_size=16, num_gpu_blocks=256)
    else:
        cfg.update(cache_max_entry_count=0.3)
    t0 = time.perf_counter()
    pipe = pipeline(args.model, backend_config=PytorchEngineConfig(**cfg), log_level="ERROR")
    out["load_s"] = time.perf_counter() - t0
    try:
        tok = pipe.async_engine.tokenizer
        prompts = chat_prompts(getattr(tok, "model", tok), max(args.prompts, max(batches)))
        run = generator(pipe)
        out["prompt_ids"] = [tok.encode(p, add_bos=True) for p in prompts[:args.prompts]]
        out["tokens"] = run(args.prompts, args.new_tokens, prompts=prompts)
        rates = {}
        for b in batches:
            t_n = t_1 = float("inf")
            for _ in range(args.repeats):
                s = time.perf_counter()
                run(b, args.new_tokens, prompts=prompts)
                t_n = min(t_n, time.perf_counter() - s)
                s = time.perf_counter()
                run(b, 1, prompts=prompts)
                t_1 = min(t_1, time.perf_counter() - s)
            rates[str(b)] = decode_rate(b, args.new_tokens, t_n, t_1)
        out["decode_tok_s"] = rates
        if args.eager and side["device_type"] != "cpu":  # where an eager step's host time goes (GPU only:
            # the interpreter's Python calls would swamp the profiler)
            out["host_profile"] = host_profile(run, max(batches), min(8, args.new_tokens), prompts)
    finally:
        pipe.close()
    Path(args.out).write_text(json.dumps(out))
    return 0


def host_profile(run, batch: int, new_tokens: int, prompts, top: int = 25) -> dict:
    """One generation of `batch` sequences under torch.profiler (CPU activity with Python stacks,
    every thread: the engine's forward runs in its own): the torch ops and Python functions with
    the most self time, calls and self time per generated token. Threads waiting (locks,
    sockets, polls) are left out: idle, not work. Eager dlinfer_cuda decoded at half the native
    eager rate at batch 16 and 64 on the H200 (docs/gpu.md): this names where the host time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:  # the engine's own thread too (torch >= 2.8 has the switch)
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        config = None
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config, with_stack=True) as prof:
        start = time.perf_counter()
        run(batch, new_tokens, prompts=prompts)
        wall = time.perf_counter() - start
    idle = ("wait", "acquire", "select", "poll", "sleep", "recv", "send")
    rows = sorted((e for e in prof.key_averages() if not any(w in e.key for w in idle)),
                  key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    steps = max(1, new_tokens)
    return {"batch": batch, "new_tokens": new_tokens, "wall_ms_per_step": 1e3 * wall / steps,
            "torch": torch.__version__, "top_self_cpu": [{"op": e.key, "calls_per_step": e.count / steps,
                              "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in rows]}


def run_side(name, device_type, vendor, eager, model, batches, args, timeout) -> dict:
    """One side in a process group of its own, killed past `timeout`: its JSON, or {"error": ...}."""
    out = Path(args.work) / f"{Path(model).name}-{name}.json"
    side = dict(device_type=device_type, vendor=vendor)
    cmd = [sys.executable, __file__, "--child", json.dumps(side), "--model", str(model), "--out", str(out),
           "--dtype", args.dtype, "--batches", batches, "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.repeats), "--prompts", str(args.prompts)] + (["--eager"] if eager else [])
    t0 = time.perf_counter()
    rc, stdout, stderr = run_limited(cmd, timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if rc is None:
        return {"error": f"timed out after {timeout:.0f} s", "eager": eager}
    if rc != 0 or not out.is_file():
        tail = (stderr or stdout).strip().splitlines()[-12:]
        return {"error": f"exit {rc}: " + " | ".join(tail)[-1500:], "eager": eager}
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def first_divergence(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain(hf, prompt_ids, common, tok_a, tok_b, device) -> dict:
    """HF's logits after prompt + common prefix: the top-2 margin and the two chosen tokens' gap."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + common], device=device)).logits[0, -1].float()
    top = logits.topk(2)
    return {"hf_top1": int(top.indices[0]), "top2_margin": float(top.values[0] - top.values[1]),
            "chosen_gap": float(logits[tok_a] - logits[tok_b]),
            "bf16_ulp_at_top1": float(torch.finfo(torch.bfloat16).eps * top.values[0].abs())}


def compare(model, a: dict, b: dict, dtype, device) -> list:
    rows, hf = [], None
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        at = first_divergence(ta, tb)
        row = {"prompt": i, "equal": at is None}
        if at is not None:
            row["first_divergence"] = at
            try:
                if hf is None:  # HF's model, loaded once, only when a prompt diverges
                    import torch
                    from transformers import AutoModelForCausalLM

                    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
                row.update(explain(hf, a["prompt_ids"][i], ta[:at], ta[at], tb[at], device))
            except Exception as exc:  # the explanation is best effort; the difference stands
                row["explain_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="prompts whose greedy tokens are compared")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--tokenizer", default=None, help="SmolLM2's tokenizer folder (for --models smollm2)")
    ap.add_argument("--side-timeout", type=int, default=150, help="most seconds for one side's process")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run: a side gets at most what is left (default: no limit)")
    ap.add_argument("--work", default=None, help="folder for the sides' JSON (default: a temporary one)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--dry-run", action="store_true", help="CPU sides (triton interpreted vs torch), tiny")
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    import tempfile

    import torch

    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the triton vendor on the CPU: set TRITON_INTERPRET=1")
        sides, device = DRY_SIDES, "cpu"
        # two prompts: the interpreted side's batch of prompts was half of the dry run's engine step
        args.models, args.batches, args.new_tokens, args.repeats, args.prompts = "tiny", "1,2", 4, 1, 2
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_engine.py needs a CUDA GPU (or --dry-run)")
        sides, device = GPU_SIDES, "cuda"
    args.work = args.work or tempfile.mkdtemp(prefix="gpu_engine-")
    start = time.perf_counter()
    report = {"dry_run": args.dry_run, "dtype": args.dtype, "batches": args.batches,
              "new_tokens": args.new_tokens, "models": {}}
    ok = True
    for name in args.models.split(","):
        model = build_model(name, args.tokenizer)
        entry = report["models"][name] = {"path": str(model)}
        # the tiny model checks tokens only (batch 1); speed is the SmolLM2-shaped model's
        batches = args.batches if name != "tiny" or args.dry_run else "1"
        for side_name, device_type, vendor, eager in sides:
            if name == "tiny" and not eager:
                continue
            left = (args.budget - (time.perf_counter() - start)) if args.budget else args.side_timeout
            if left < 20:
                entry[side_name] = {"error": f"skipped: {left:.0f} s left of the {args.budget:.0f} s budget"}
                continue
            res = entry[side_name] = run_side(side_name, device_type, vendor, eager, model, batches, args,
                                              min(args.side_timeout, left - 5))
            rates = res.get("decode_tok_s")
            print(f"[engine] {name} {side_name}: " + (f"decode tok/s {rates}" if rates else res.get("error", "")),
                  flush=True)
            write_report(args.json, report)  # after every side: a step killed later keeps what was done
        a, b = entry.get("dlinfer_cuda", {}), entry.get("native", {})
        if "tokens" in a and "tokens" in b:
            entry["tokens"] = compare(model, a, b, args.dtype, device)
            same = sum(r["equal"] for r in entry["tokens"])
            print(f"[engine] {name}: greedy tokens equal on {same}/{len(entry['tokens'])} prompts", flush=True)
            for r in entry["tokens"]:
                if not r["equal"]:
                    print(f"  prompt {r['prompt']}: first divergence at token {r['first_divergence']}; HF top-2 margin "
                          f"{r.get('top2_margin', float('nan')):.4f}, chosen tokens' gap "
                          f"{r.get('chosen_gap', float('nan')):.4f} (bf16 ulp there "
                          f"{r.get('bf16_ulp_at_top1', float('nan')):.4f})", flush=True)
        else:
            ok = False
        for b_ in batches.split(","):
            ra = a.get("decode_tok_s", {}).get(b_)
            others = [(n, entry.get(n, {}).get("decode_tok_s", {}).get(b_)) for n in ("native", "native_cudagraph")]
            cells = [f"{n} {r:.1f} ({ra / r:.2f}x)" for n, r in others if ra and r]
            if cells:
                print(f"[engine] {name} batch {b_}: dlinfer_cuda {ra:.1f} tok/s; " + "; ".join(cells), flush=True)
        write_report(args.json, report)
    return 0 if ok else 1


def write_report(path, report) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
