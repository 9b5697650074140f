"""Timing, peaks, result rows and time-limited subprocesses shared by the GPU benchmarks (bench_triton_ops.py,
bench_triton_attention.py, gpu_engine.py) and their CPU dry runs (scripts/gpu_check.sh --dry-run).

On CUDA a time is the median of CUDA-event intervals, the L2 cache flushed (a 256 MiB write)
before each call, so no call is served from the previous one's cache, and the GPU then held busy
(torch.cuda._sleep, ~0.5 ms) while the host issues the call: the interval is the kernels' own
time, not the host's launch work (which made decode-sized rows of the first H200 runs read 5 us
one run and 50 the next). That host work is measured apart (`host_time`: the median wall-clock
of issuing one call while the GPU is busy), since an eager engine pays it. On the CPU (a dry run
under TRITON_INTERPRET=1) a time is the median wall-clock of `reps` calls without a warm-up: it proves
that the code path runs, and is no timing.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# (substrings all in the device name, peak HBM bytes/s, dense bf16 FLOP/s without sparsity)
PEAKS = (
    (("H200",), 4.8e12, 989e12),
    (("H100", "PCIe"), 2.0e12, 756e12),
    (("H100", "NVL"), 3.9e12, 835e12),
    (("H100",), 3.35e12, 989e12),  # SXM (HBM3)
    (("A100", "80GB"), 2.0e12, 312e12),
)

_flush: dict = {}
BUSY_CYCLES = 1_000_000  # ~0.5 ms at the H200's 1.98 GHz: longer than any launcher's host work


def device_time(fn, reps: int, device: str, warmup: int = 3) -> float:
    """Median seconds of one fn() call over `reps` calls (see the module docstring)."""
    if not str(device).startswith("cuda"):  # a dry run: each call's wall-clock, no warm-up (it times nothing)
        from bench_cpu_ops import median_time  # benchmarks/ is on sys.path when a benchmark runs

        return median_time(fn, reps, warmup=0)
    for _ in range(warmup):
        fn()
    if device not in _flush:
        _flush[device] = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    flush = _flush[device]
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    leaked = 0
    for i in range(reps):
        flush.zero_()
        torch.cuda._sleep(BUSY_CYCLES)  # the host's launch work overlaps this, not the interval
        starts[i].record()
        fn()
        ends[i].record()
        leaked += bool(starts[i].query())  # the GPU reached the start before the host had issued fn
    torch.cuda.synchronize()
    if leaked:
        print(f"gpu_timing: in {leaked} of {reps} reps the GPU waited for the host: those intervals hold host "
              "time (raise BUSY_CYCLES)", file=sys.stderr, flush=True)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3


def host_time(fn, reps: int, device: str) -> float:
    """Median seconds the host takes to issue one fn() call (launches, allocations, Python), the
    GPU kept busy so that no call waits for it (a call that synchronises would count the queued
    sleeps: none of the timed calls does). CPU (a dry run): the whole call's wall-clock."""
    times = []
    cuda = str(device).startswith("cuda")
    if cuda:
        fn()  # warm (a dry run's interpreted calls are slow enough without it)
    for _ in range(reps):
        if cuda:
            torch.cuda._sleep(BUSY_CYCLES)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def peaks(device: str) -> dict:
    """{"name", "bytes_per_s", "flops" (or None), "source"} of `device`: the table above by name, else
    a measured 1 GiB device copy (read + write) and no FLOP peak. CPU: no peaks (a dry run)."""
    if not str(device).startswith("cuda"):
        return {"name": "cpu (dry run)", "bytes_per_s": None, "flops": None, "source": "none: a dry run"}
    name = torch.cuda.get_device_name(device)
    for keys, bw, flops in PEAKS:
        if all(k in name for k in keys):
            return {"name": name, "bytes_per_s": bw, "flops": flops, "source": "table"}
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / device_time(lambda: dst.copy_(src), 20, device)
    return {"name": name, "bytes_per_s": bw, "flops": None, "source": "measured 1 GiB device copy"}


def share(value, peak) -> str:
    """'42%' of a peak, or '-' where either is unknown."""
    return f"{100 * value / peak:.0f}%" if value and peak else "-"


def require_interpreter() -> None:
    """A --dry-run runs the triton kernels on the CPU: exit, saying so, unless TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run runs the triton kernels on the CPU: set TRITON_INTERPRET=1")


def write_json(path, payload: dict) -> None:
    """Write `payload` (rows and context) as indented JSON; a None path writes nothing."""
    if path:
        Path(path).write_text(json.dumps(payload, indent=1, default=str) + "\n")


def run_limited(argv, timeout: float, **popen_kwargs):
    """Run argv in a process group of its own; past `timeout` seconds kill the whole group (an
    LMDeploy engine's own worker processes too, which would otherwise hold the GPU for the next
    step). Returns (returncode, or None when it timed out; stdout; stderr), the outputs as text
    where they were piped."""
    proc = subprocess.Popen(argv, start_new_session=True, text=True, **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err
