"""Running the conformance checks against one vendor (docs/conformance.md).

`run(vendor)` selects the vendor, makes every input on its device, turns value checks on (the
garbage-metadata checks turn them off where they need to), runs each check under the vendor and
the check's KV layout, and records one `Result` per check: passed, failed (with the mismatch's
count, worst errors and index, or the exception), or skipped (with the capability, or the
vendor's own declaration, that excludes it). Checks run grouped by op, in the op table's order.
"""

from __future__ import annotations

import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

import dlinfer
from dlinfer.conformance import tolerances
from dlinfer.conformance.checks import Check, Skipped, matches, skip_reason
from dlinfer.conformance.compare import Mismatch
from dlinfer.conformance.inputs import clear_memo, dtype_name, on_device, value_checks
from dlinfer.conformance.suites import checks_for
from dlinfer.errors import VendorError
from dlinfer.vendor import registry, selection
from dlinfer.vendor.op_table import OP_NAMES

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class Result:
    check: Check
    status: str
    seconds: float = 0.0
    reason: Optional[str] = None  # why it was skipped
    declared: bool = False  # skipped, or run at a tolerance, by the vendor's own declaration
    tolerances: list = field(default_factory=list)  # (op, dtype, (atol, rtol)) the vendor declared and got
    note: Optional[str] = None  # e.g. "rejected: ..." for a strided input the vendor refuses
    error: Optional[dict] = None  # what failed

    @property
    def op(self) -> str:
        return self.check.op


@dataclass
class Report:
    vendor: str
    device: str
    kv_layouts: tuple
    options: dict
    results: List[Result]
    seconds: float
    declared_tolerances: dict
    declared_skips: dict
    versions: dict

    def count(self, status: str, op: Optional[str] = None) -> int:
        return sum(1 for r in self.results if r.status == status and (op is None or r.op == op))

    @property
    def ok(self) -> bool:
        return self.count(FAILED) == 0

    def ops(self) -> list:
        """The ops of the results, in the order they ran."""
        return list(dict.fromkeys(r.op for r in self.results))


def default_device(vendor) -> torch.device:
    """The first of the vendor's device types this machine has ('*': cuda if present, else cpu)."""
    for device_type in vendor.device_types:
        if device_type == "*":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            torch.empty(1, device=device_type)
        except Exception:
            continue
        return torch.device(device_type)
    raise VendorError(f"vendor {vendor.name!r} runs on {', '.join(vendor.device_types)}: none of them is "
                      f"available here")


def _op_order(op: str) -> int:
    return OP_NAMES.index(op) if op in OP_NAMES else len(OP_NAMES)


def select(vendor, ops: Optional[Sequence[str]] = None, dtypes: Optional[Sequence[torch.dtype]] = None,
           small: bool = False, patterns: Optional[Sequence[str]] = None) -> List[Check]:
    """The checks for `vendor` (its KV layouts), narrowed to `ops` (a multi-op check needs all of
    its ops named), `dtypes`, the small ones, and check-id patterns; grouped by op."""
    chosen = []
    for check in checks_for(vendor.kv_layouts, small=small):
        if ops is not None and check.op not in ops and not set(check.ops) <= set(ops):
            continue
        if dtypes is not None and check.dtype not in dtypes:
            continue
        if patterns and not any(matches(p, check) for p in patterns):
            continue
        chosen.append(check)
    return sorted(chosen, key=lambda c: _op_order(c.op))  # stable: suite order inside an op


def execute(vendor, check: Check):
    """Run one check under `vendor` and the check's KV layout, with the vendor's declared
    tolerances; returns the check's note, raises what the check raises (Skipped, CheckFailed,
    Mismatch, or the vendor's own exception). The device and value checks are the caller's."""
    caps = vendor.capabilities
    with selection.using(vendor.name, check.layout), tolerances.declared(caps.conformance_tolerances):
        device_type = _device_type()
        for op in check.ops:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runs_on = selection.resolve(op, device_type)[1]
            if runs_on.name != vendor.name:
                raise Skipped(f"{op} runs on the {runs_on.name} vendor here (DLINFER_FALLBACK_OPS)")
        return check.fn(vendor)


def one_line(error: dict) -> str:
    """A failed check's error (Result.error) in one line of at most 300 characters."""
    if error.get("type") == "mismatch":
        return (f"{error['output']}: {error['mismatches']}/{error['elements']} elements off, max abs err "
                f"{error['max_abs_err']:.4g}, max rel err {error['max_rel_err']:.4g}, worst at "
                f"{tuple(error['worst_index'])}")
    first = next((line for line in str(error.get("message", "")).splitlines() if line.strip()), "")
    name = error.get("exception")
    return f"{name}: {first}"[:300] if name else first[:300]


def _device_type() -> str:
    from dlinfer.conformance.inputs import device

    return device().type


def _error(exc: BaseException) -> dict:
    if isinstance(exc, Mismatch):
        return {"type": "mismatch", "message": str(exc), **exc.details}
    if isinstance(exc, AssertionError):
        return {"type": "assertion", "message": str(exc)}
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    return {"type": "exception", "exception": type(exc).__name__, "message": str(exc), "where": where}


def run_one(vendor, check: Check) -> Result:
    reason, declared = skip_reason(vendor, check)
    if reason is not None:
        return Result(check, SKIPPED, reason=reason, declared=declared)
    start = time.perf_counter()
    try:
        note = execute(vendor, check)
    except Skipped as exc:
        return Result(check, SKIPPED, time.perf_counter() - start, reason=str(exc))
    except Exception as exc:  # a vendor may fail in any way: record it, keep going
        result = Result(check, FAILED, time.perf_counter() - start, error=_error(exc))
    else:
        result = Result(check, PASSED, time.perf_counter() - start, note=note if isinstance(note, str) else None)
    result.tolerances = tolerances.used()
    result.declared = bool(result.tolerances)
    return result


def run(vendor_name: str, ops: Optional[Sequence[str]] = None, dtypes: Optional[Sequence[torch.dtype]] = None,
        small: bool = False, device=None, patterns: Optional[Sequence[str]] = None,
        progress: Optional[Callable[[str], None]] = None) -> Report:
    """Run the conformance checks against the vendor named `vendor_name` (VendorError when it
    cannot load, ValueError when its declarations are malformed). progress(line) is called once
    per op, once per failed check as it fails, and with a running counter (a line starting
    with '\\r')."""
    vendor = registry.load(vendor_name)
    caps = vendor.capabilities
    declared_tol = dict(caps.conformance_tolerances or {})
    declared_skips = dict(caps.conformance_skips or {})
    problems = tolerances.check_declaration(declared_tol)
    problems += [f"conformance_skips {k!r}: expected a str pattern -> a str reason" for k, v in declared_skips.items()
                 if not isinstance(k, str) or not isinstance(v, str)]
    if problems:
        raise ValueError(f"vendor {vendor_name!r} declares malformed conformance settings: " + "; ".join(problems))
    dev = torch.device(device) if device is not None else default_device(vendor)
    checks = select(vendor, ops, dtypes, small, patterns)
    results: List[Result] = []
    start = time.perf_counter()
    try:
        with on_device(dev), value_checks(True):
            for i, op in enumerate(dict.fromkeys(c.op for c in checks)):
                group = [c for c in checks if c.op == op]
                op_start = time.perf_counter()
                mine = []
                for j, check in enumerate(group):
                    if progress is not None:
                        progress(f"\r[{len(results) + j + 1}/{len(checks)}] {op} {check.id}")
                    mine.append(run_one(vendor, check))
                    if progress is not None and mine[-1].status == FAILED:
                        # at once, so a run cut off by a time limit still tells which checks failed
                        progress(f"  FAILED {check.id}: {one_line(mine[-1].error)}")
                results += mine
                if progress is not None:
                    counts = {s: sum(r.status == s for r in mine) for s in (PASSED, FAILED, SKIPPED)}
                    progress(f"{op:<26} {counts[PASSED]:>5} passed {counts[FAILED]:>5} failed "
                             f"{counts[SKIPPED]:>5} skipped  ({time.perf_counter() - op_start:.1f} s)")
    finally:
        clear_memo()
    options = {"ops": list(ops) if ops else None, "dtypes": [dtype_name(d) for d in dtypes] if dtypes else None,
               "small": small, "checks": list(patterns) if patterns else None}
    versions = {"dlinfer": dlinfer.__version__, "torch": torch.__version__}
    return Report(vendor.name, str(dev), tuple(vendor.kv_layouts), options, results, time.perf_counter() - start,
                  {(f"{k[0]}/{dtype_name(k[1])}" if isinstance(k, tuple) else k): list(v)
                   for k, v in declared_tol.items()}, declared_skips, versions)
