"""DLINFER_OP_COMPARE / `dlinfer.tools.compare()`: every call also runs on the torch vendor in
float64, and the first call of each op whose result leaves the tolerance table's bound is
reported with its arguments (and dumped as a one-call capture that `python -m dlinfer replay`
reruns), like ditorch's autocompare; the engine goes on.

The reference runs on float64 copies of the call's arguments (its KV caches cut to the blocks
the call reads, dlinfer/tools/_record.py), on the call's device. The torch vendor computes some
intermediates in float32 whatever the input dtype (rms_norm's statistics): the reference is at
least float32-accurate, far inside the half-precision bounds and within the float32 ones.
`diff` is also what `python -m dlinfer replay` compares with.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from dlinfer.tools import _record, tolerances
from dlinfer.tools._hook import Call, Tool, result_names, results_of, say, stats_line
from dlinfer.vendor import registry
from dlinfer.vendor.kv_layouts import canonical


@dataclass
class Diff:
    """One result against its expected value. ratio: worst |error| / allowed (0 when equal; inf
    for an exact comparison that fails or a shape/dtype mismatch)."""

    name: str
    ok: bool
    ratio: float = 0.0
    max_abs: float = 0.0
    detail: str = ""


def _index(flat: int, shape) -> tuple:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def bounds(op: str, name: str, dtype: torch.dtype, exact_results: bool, factor: float):
    """(atol, rtol) for result `name` of `op` in `dtype`, or None for an exact comparison."""
    if not dtype.is_floating_point or op not in tolerances.FAMILY:
        return None
    if exact_results and (op, name) in tolerances.EXACT_RESULTS:
        return None
    atol, rtol = tolerances.tolerance(op, dtype)
    return atol * factor, rtol * factor


def error_scales(op: str, names, mutates, args: list) -> Dict[str, torch.Tensor]:
    """{result name: S} for the ops of `tolerances.SCALED_OPERANDS`: the op rerun by the torch vendor
    in float64 with those operands' absolute values (an upper bound on the magnitude of the terms
    each output element sums); {} for other ops. `args`: canonical, caches compacted."""
    operands = tolerances.SCALED_OPERANDS.get(op)
    if not operands:
        return {}
    from dlinfer.vendor.op_table import OPS

    spec = OPS[op]
    inputs = []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().to(torch.float64, copy=True)
            if name in operands:
                a = a.abs_()
        elif isinstance(a, torch.Tensor) and name in mutates:
            a = a.clone()
        inputs.append(a)
    result = registry.load("torch").ops[op](*inputs)
    scales = dict(zip(result_names(spec), results_of(result)))
    for name in mutates:
        if name not in _record.CACHE_ARGS:
            scales[name] = inputs[list(names).index(name)]
    return scales


def diff(actual: torch.Tensor, expected: torch.Tensor, op: str, name: str, *, exact_results: bool,
         factor: float = 1.0, scale: Optional[torch.Tensor] = None) -> Diff:
    """`actual` (the vendor's, its dtype picks the table row) against `expected` (any dtype);
    `scale`: the error scale S of each element (`error_scales`), atol then counts S times."""
    if tuple(actual.shape) != tuple(expected.shape):
        return Diff(name, False, float("inf"), float("inf"),
                    f"shape {list(actual.shape)}, expected {list(expected.shape)}")
    tol = bounds(op, name, actual.dtype, exact_results, factor)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return Diff(name, True)
    same = (a == e) | (a.isnan() & e.isnan())
    err = torch.where(same, torch.zeros_like(a), (a - e).abs())
    err = torch.nan_to_num(err, nan=float("inf"))
    if tol is None:
        bad = ~same
        bound = torch.zeros_like(a)
        rule = f"{str(actual.dtype).replace('torch.', '')}, exact"
    else:
        atol, rtol = tol
        if scale is not None and tuple(scale.shape) == tuple(a.shape):
            s = scale.detach().to("cpu", torch.float64).nan_to_num(nan=1.0, posinf=1.0).clamp(min=1.0)
            bound = atol * s + rtol * e.abs().nan_to_num(posinf=0.0)
            scaled = " x max(1, S)"
        else:
            bound = atol + rtol * e.abs().nan_to_num(posinf=0.0)
            scaled = ""
        bad = err > bound
        times = f" ({factor:g} x table)" if factor != 1 else ""
        rule = f"{str(actual.dtype).replace('torch.', '')}, atol={atol:.3g}{scaled}, rtol={rtol:.3g}{times}"
    n_bad = int(bad.sum())
    max_abs = float(err.max())
    if tol is None:
        ratio = 0.0 if n_bad == 0 else float("inf")
    else:
        ratio = float((err / bound).max())
    if n_bad == 0:
        return Diff(name, True, ratio, max_abs)
    score = torch.where(bad, err / bound.clamp(min=1e-300), torch.zeros_like(err))
    worst = _index(int(score.reshape(-1).argmax()), a.shape)
    first = _index(int(bad.reshape(-1).nonzero()[0]), a.shape)
    detail = (f"{n_bad} / {a.numel()} elements out of tolerance ({rule}); worst at {worst}: got "
              f"{float(a[worst])!r}, expected {float(e[worst])!r} (|err| {float(err[worst]):.4g}, allowed "
              f"{float(bound[worst]):.4g}); first at {first}")
    return Diff(name, False, ratio, max_abs, detail)


def results_diffs(op: str, names, got: tuple, want: tuple, *, exact_results: bool, factor: float = 1.0,
                  scales: Optional[dict] = None) -> List[Diff]:
    """`diff` of each returned tensor. Top-k ids may differ where the two sides' weights agree
    within tolerance (a near tie between experts, which either order resolves correctly)."""
    scales = scales or {}
    diffs = [diff(g, w, op, n, exact_results=exact_results, factor=factor, scale=scales.get(n))
             for n, g, w in zip(names, got, want)]
    if op == "moe_gating_topk_softmax" and len(diffs) == 2 and diffs[0].ok and not diffs[1].ok:
        ids_differ = got[1].detach().cpu() != want[1].detach().cpu()
        atol, rtol = tolerances.tolerance(op, got[0].dtype)
        w_got = got[0].detach().to("cpu", torch.float64)
        w_want = want[0].detach().to("cpu", torch.float64)
        tie = (w_got - w_want).abs() <= factor * (atol + rtol * w_want.abs())
        if bool(tie[ids_differ].all()):
            diffs[1] = Diff(diffs[1].name, True, 0.0, diffs[1].max_abs, "ids differ only between tied experts")
    return diffs


def _reference_input(a):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return a.detach().to(torch.float64, copy=True)
    if isinstance(a, torch.Tensor):
        return a.detach().clone()
    return a


class Compare(Tool):
    """Rerun every call (of `ops`, default all) on the torch vendor in float64; report the first
    call of each op that leaves tolerance, dumping it under `dump_dir` (one folder per op)."""

    name = "compare"

    def __init__(self, ops=None, dump_dir: Optional[str] = None):
        super().__init__(ops)
        self.dump_dir = dump_dir or os.path.join(tempfile.gettempdir(), f"dlinfer-compare-{os.getpid()}")
        self.checked = 0
        self.bad_calls: Dict[str, List[int]] = {}  # op -> [call numbers]
        self.reports: List[str] = []  # the first report of each op
        self.refused: Dict[str, str] = {}  # op -> why the reference could not run

    def before(self, call: Call):
        if call.op in self.refused:
            return None
        args, blocks = _record.compacted_args(call)
        return [_reference_input(a) for a in args], blocks

    def after(self, call: Call, result, state) -> None:
        ref_args, blocks = state
        fn = registry.load("torch").ops[call.op]
        mutated = {call.names.index(name) for name in call.spec.mutates}
        # ref_args stay as they were (the dump needs them): the reference writes into copies
        inputs = [a.clone() if i in mutated else a for i, a in enumerate(ref_args)]
        try:
            ref_result = fn(*inputs)
        except Exception as exc:
            with self.lock:
                self.refused.setdefault(call.op, f"{type(exc).__name__}: {exc}")
            say(self.name, f"{call.op}: the float64 torch reference failed ({type(exc).__name__}: {exc}); "
                           f"this op is not compared")
            return
        scales = error_scales(call.op, call.names, call.spec.mutates, ref_args)
        diffs = results_diffs(call.op, result_names(call.spec), results_of(result), results_of(ref_result),
                              exact_results=False, scales=scales)
        written_now = {}
        for name in call.spec.mutates:
            i = call.names.index(name)
            got = call.args[i]
            if name in _record.CACHE_ARGS:
                got = _record.cache_after(got, blocks)
                layout = call.arg("kv_layout")
                written_now[name] = got
                diffs.append(diff(canonical(got, layout), canonical(inputs[i], layout), call.op, name,
                                  exact_results=False))
            else:
                written_now[name] = got.detach().clone()
                diffs.append(diff(got, inputs[i], call.op, name, exact_results=False, scale=scales.get(name)))
        bad = [d for d in diffs if not d.ok]
        with self.lock:
            self.checked += 1
            if not bad:
                return
            calls = self.bad_calls.setdefault(call.op, [])
            calls.append(call.index)
            first = len(calls) == 1
        if first:
            self._report(call, bad, ref_args, result, written_now)

    def _report(self, call: Call, bad: List[Diff], ref_args: list, result, written_now: dict) -> None:
        lines = [f"{call.title()} leaves tolerance against the torch vendor in float64 "
                 f"(first of this op; later ones are counted):"]
        for d in bad:
            lines.append(f"  {d.name}: {d.detail}")
        # the arguments before the call, in their own dtypes (exact: they were widened from them)
        args = [a.to(orig.dtype) if isinstance(a, torch.Tensor) else a for a, orig in zip(ref_args, call.args)]
        lines.append("  arguments (as the vendor got them; KV caches cut to the blocks the call reads):")
        for name, a in zip(call.names, args):
            lines.append(f"    {name}: {stats_line(a) if isinstance(a, torch.Tensor) else repr(a)}")
        folder = os.path.join(self.dump_dir, f"{call.index:07d}-{call.op}")
        try:
            from dlinfer.tools.capture import write_single

            write_single(folder, call, args, result, written_now)
            lines.append(f"  dumped to {folder} (python -m dlinfer replay {folder} --vendor torch)")
        except Exception as exc:  # the report matters more than the dump
            lines.append(f"  (could not dump the call: {type(exc).__name__}: {exc})")
        text = "\n".join(lines)
        with self.lock:
            self.reports.append(text)
        say(self.name, text)

    def summary(self) -> str:
        with self.lock:
            if not self.bad_calls:
                refused = f"; not compared: {sorted(self.refused)}" if self.refused else ""
                return f"[dlinfer compare] {self.checked} calls checked against the torch vendor in float64: " \
                       f"all within tolerance{refused}"
            parts = [f"{op} ({len(c)} calls, first #{c[0]})" for op, c in sorted(self.bad_calls.items())]
            return (f"[dlinfer compare] {self.checked} calls checked against the torch vendor in float64; "
                    f"out of tolerance: {', '.join(parts)}; first calls dumped under {self.dump_dir}")
