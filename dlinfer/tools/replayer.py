"""`python -m dlinfer replay DIR [--vendor NAME] [--ops a,b] [--repeat N] [--device D]`: rerun
captured calls (dlinfer/tools/capture.py) on a vendor, compare every result and in-place
argument with the captured one, time each call, print a per-op table; the exit status is 1 when
any result leaves tolerance or a call fails (docs/tools.md, "Replay").

Tolerance: the project's table (dlinfer/tools/tolerances.py) for the result's dtype, times
REPLAY_FACTOR (2: the captured result came from another vendor, not from an exact reference);
results every correct vendor gets bit for bit (KV writes, top-k ids, the sum of add_rms_norm,
integer results) must be equal. A vendor that lacks an op replays it on the torch vendor (the
table says so); a call in a dtype the vendor does not declare, or that it refuses with
UnsupportedError, is counted as skipped.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from dlinfer.errors import UnsupportedError, VendorError
from dlinfer.tools import _record, tolerances
from dlinfer.tools._hook import result_names
from dlinfer.tools.compare import diff, error_scales, results_diffs
from dlinfer.vendor import registry, selection
from dlinfer.vendor.base import Vendor
from dlinfer.vendor.kv_layouts import HEAD_MAJOR, TOKEN_MAJOR, canonical
from dlinfer.vendor.op_table import OPS

MAX_FAILURE_LINES = 10


@dataclass
class OpRow:
    op: str
    vendors: set = field(default_factory=set)
    calls: int = 0
    mismatches: int = 0
    errors: int = 0
    skipped: int = 0
    worst: float = 0.0  # worst |error| / allowed over every compared result
    max_abs: float = 0.0
    times: List[float] = field(default_factory=list)


@dataclass
class ReplayReport:
    directory: str
    vendor: str
    captured: int  # calls in the capture (before the op filter)
    rows: Dict[str, OpRow] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)  # one line per mismatching / failing call
    devices: set = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return all(r.mismatches == 0 and r.errors == 0 for r in self.rows.values())

    def table(self) -> str:
        lines = [f"{'op':<26}{'vendor':<18}{'calls':>7}{'mismatch':>10}{'errors':>8}{'skipped':>9}"
                 f"{'worst err/tol':>15}{'max abs err':>13}{'median ms':>11}"]
        for op in sorted(self.rows):
            r = self.rows[op]
            median = f"{statistics.median(r.times) * 1e3:.3f}" if r.times else "-"
            worst = "inf" if r.worst == float("inf") else f"{r.worst:.3f}"
            vendor = ",".join(sorted(r.vendors)) or "-"
            lines.append(f"{op:<26}{vendor:<18}{r.calls:>7}{r.mismatches:>10}{r.errors:>8}{r.skipped:>9}"
                         f"{worst:>15}{r.max_abs:>13.3g}{median:>11}")
        return "\n".join(lines)

    def text(self) -> str:
        calls = sum(r.calls for r in self.rows.values())
        bad = sum(r.mismatches for r in self.rows.values())
        errors = sum(r.errors for r in self.rows.values())
        devices = ",".join(sorted(self.devices)) or "-"
        head = (f"replay of {self.directory}: {calls} of {self.captured} captured calls on vendor {self.vendor} "
                f"(device {devices}); worst err/tol: worst |replay - captured| / allowed (<= 1 passes)")
        out = [head, ""]
        if self.failures:
            out += self.failures[:MAX_FAILURE_LINES]
            if len(self.failures) > MAX_FAILURE_LINES:
                out.append(f"... and {len(self.failures) - MAX_FAILURE_LINES} more")
            out.append("")
        out.append(self.table())
        out.append("")
        verdict = "OK" if self.ok else "FAILED"
        out.append(f"{verdict}: {bad} mismatching calls, {errors} failing calls")
        return "\n".join(out)


def read_index(directory: str) -> List[dict]:
    path = os.path.join(directory, "calls.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory}: no calls.jsonl here; is it a DLINFER_OP_CAPTURE directory?")
    calls = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    calls.append(json.loads(line))
                except json.JSONDecodeError:  # the last line of a capture killed mid-write
                    continue
    return calls


def _available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    mod = getattr(torch, device_type, None)
    return bool(mod is not None and getattr(mod, "is_available", lambda: False)())


def _device_for(captured: str, vendor: Vendor, override: Optional[str]) -> torch.device:
    if override:
        return torch.device(override)
    captured_dev = torch.device(captured)
    types = vendor.device_types
    if ("*" in types or captured_dev.type in types) and _available(captured_dev.type):
        return captured_dev
    for t in types:
        if t != "*" and _available(t):
            return torch.device(t)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _other_layout(layout: str) -> str:
    return HEAD_MAJOR if layout == TOKEN_MAJOR else TOKEN_MAJOR


def _resolve_vendor(vendor: Union[None, str, Vendor], device_type: str) -> Vendor:
    if isinstance(vendor, Vendor):
        return vendor
    if vendor:
        return registry.load(vendor)
    return selection.current(device_type)


def _first_float_dtype(args: Sequence) -> Optional[torch.dtype]:
    return next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)


def replay(directory: str, vendor: Union[None, str, Vendor] = None, ops: Optional[Sequence[str]] = None,
           repeat: int = 1, device: Optional[str] = None, progress: Optional[Callable[[str], None]] = None
           ) -> ReplayReport:
    """Rerun the calls captured under `directory` on `vendor` (default: the active vendor for the
    capture's device type); see the module docstring."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    index = read_index(directory)
    wanted = set(ops) if ops else None
    if wanted:
        unknown = sorted(wanted - set(OPS))
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {sorted(OPS)}")
    first_device = torch.device(index[0]["device"]).type if index else "cpu"
    target = _resolve_vendor(vendor, first_device)
    torch_vendor = registry.load("torch")
    report = ReplayReport(os.path.abspath(directory), target.name, len(index))
    blobs = _record.BlobCache(directory)
    selected = [m for m in index if wanted is None or m["op"] in wanted]
    last_note = time.monotonic()
    with torch.inference_mode():
        for n, meta in enumerate(selected, 1):
            if progress is not None and time.monotonic() - last_note > 10:
                progress(f"replay: {n - 1} of {len(selected)} calls done")
                last_note = time.monotonic()
            _replay_one(directory, meta, target, torch_vendor, device, repeat, blobs, report)
    return report


def _replay_one(directory, meta, target: Vendor, torch_vendor: Vendor, device_override, repeat, blobs, report):
    op = meta["op"]
    spec = OPS[op]
    row = report.rows.setdefault(op, OpRow(op))
    row.calls += 1
    title = f"call #{meta['call']} {op}"
    fn = target.ops.get(op)
    runner = target
    if fn is None:
        fn, runner = torch_vendor.ops[op], torch_vendor
    dev = _device_for(meta["device"], runner, device_override)
    report.devices.add(str(dev))
    row.vendors.add(runner.name if runner is target else "torch (fallback)")
    record = torch.load(os.path.join(directory, meta["file"]), weights_only=True)
    args = _record.decode_args(record, blobs, dev)
    dtype = _first_float_dtype(args)
    if dtype is not None and dtype not in runner.capabilities.dtypes:
        row.skipped += 1
        return
    names = spec.arg_names
    layout_captured = layout = None
    if spec.takes_kv_cache:
        layout_captured = layout = args[names.index("kv_layout")]
        if layout not in runner.kv_layouts:  # the same cache in the vendor's layout
            layout = _other_layout(layout)
            args[names.index("kv_layout")] = layout
            for name in _record.CACHE_ARGS:
                i = names.index(name)
                args[i] = args[i].transpose(1, 2).contiguous()
    scales = None
    if spec.name in tolerances.SCALED_OPERANDS:  # before the call: an in-place result may alias an input
        scales = error_scales(op, names, spec.mutates, args)
    try:
        _sync(dev)
        start = time.perf_counter()
        result = fn(*args)
        _sync(dev)
        row.times.append(time.perf_counter() - start)
    except UnsupportedError:
        row.skipped += 1
        return
    except Exception as exc:
        row.errors += 1
        report.failures.append(f"ERROR {title}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return
    diffs = []
    results = () if result is None else (tuple(result) if isinstance(result, (tuple, list)) else (result,))
    expected = record["results"]
    if len(results) != len(expected):
        diffs.append(f"returned {len(results)} tensors, the capture has {len(expected)}")
    diffs += results_diffs(op, result_names(spec), results, tuple(blobs.value(w) for w in expected),
                           exact_results=True, factor=tolerances.REPLAY_FACTOR, scales=scales)
    for name, want in record["written"].items():
        got = args[names.index(name)]
        want = blobs.value(want)
        if name in _record.CACHE_ARGS:
            got, want = canonical(got, layout), canonical(want, layout_captured)
        diffs.append(diff(got, want, op, name, exact_results=True, factor=tolerances.REPLAY_FACTOR,
                          scale=scales.get(name) if scales else None))
    failed = False
    for d in diffs:
        if isinstance(d, str):
            failed = True
            report.failures.append(f"MISMATCH {title}: {d}")
            continue
        row.worst = max(row.worst, d.ratio)
        row.max_abs = max(row.max_abs, d.max_abs)
        if not d.ok:
            failed = True
            report.failures.append(f"MISMATCH {title} {d.name}: {d.detail}")
    if failed:
        row.mismatches += 1
    for _ in range(repeat - 1):  # timing only (an in-place result may feed the next run)
        _sync(dev)
        start = time.perf_counter()
        fn(*args)
        _sync(dev)
        row.times.append(time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# The command line (registered in dlinfer/__main__.py)


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="a DLINFER_OP_CAPTURE directory")
    parser.add_argument("--vendor", default=None, help="vendor to replay on (default: the active one, as "
                                                       "DLINFER_VENDOR or the device's default picks it)")
    parser.add_argument("--ops", default=None, help="only these ops, comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="run each call N times; the table gives the median")
    parser.add_argument("--device", default=None, help="device to replay on (default: the captured one if the "
                                                       "vendor runs there, else the vendor's)")


def main(args) -> int:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    try:
        report = replay(args.directory, args.vendor, ops=ops, repeat=args.repeat, device=args.device,
                        progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (FileNotFoundError, ValueError, VendorError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    if not report.rows:
        print("replay: no captured calls to replay", file=sys.stderr)
        return 2
    return 0 if report.ok else 1
