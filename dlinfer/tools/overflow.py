"""DLINFER_OP_OVERFLOW=1 / `dlinfer.tools.overflow()`: NaN / inf checks on what every call
writes (its results, `out`, the KV-cache slots a fill writes), naming the first op call that
produced a non-finite value and whether its inputs were already non-finite (then the values came
from code between the ops, not from an op). Later calls are counted. `DLINFER_OP_OVERFLOW=raise`
(`overflow(raise_=True)`) raises `NonFiniteOutputError` at that call instead.

Each check reads the values: a device sync per call off the CPU.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from dlinfer.tools import _record
from dlinfer.tools._hook import Call, OpToolAlarm, Tool, result_names, results_of, say, stats_line
from dlinfer.vendor.kv_layouts import blocks_and_size, canonical


class NonFiniteOutputError(OpToolAlarm, FloatingPointError):
    """An op call produced NaN or inf (DLINFER_OP_OVERFLOW=raise)."""


def _written(call: Call, result) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) of everything the call wrote: results, in-place arguments (for a KV fill,
    the slots it wrote, not the whole caches)."""
    out = list(zip(result_names(call.spec), results_of(result)))
    for name in call.spec.mutates:
        value = call.arg(name)
        if name in _record.CACHE_ARGS:
            layout = call.arg("kv_layout")
            nb, bs = blocks_and_size(value, layout)
            slots = call.arg("kv_indices").long()
            slots = slots[(slots >= 0) & (slots < nb * bs)]
            value = canonical(value, layout)[torch.div(slots, bs, rounding_mode="floor"), slots % bs]
        out.append((name, value))
    return out


def _count(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() and t.numel() else 0


class Overflow(Tool):
    """Check every call's written values for NaN / inf; report (or raise at) the first."""

    name = "overflow"

    def __init__(self, ops=None, raise_: bool = False):
        super().__init__(ops)
        self.raise_ = raise_
        self.first: Optional[str] = None  # the report of the first call that produced one
        self.first_call: Optional[int] = None
        self.calls: Dict[str, int] = {}  # op -> calls that wrote a non-finite value

    def after(self, call: Call, result, state) -> None:
        written = _written(call, result)
        if not any(t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()) for _, t in written):
            return
        with self.lock:
            self.calls[call.op] = self.calls.get(call.op, 0) + 1
            first = self.first is None
            if first:
                self.first = ""  # claimed by this call
        if not first:
            return
        bad = [f"{name} ({_count(t)} of {t.numel()} non-finite)" for name, t in written if _count(t)]
        written_names = set(call.spec.mutates)
        inputs = [(n, a) for n, a in zip(call.names, call.args)
                  if isinstance(a, torch.Tensor) and n not in written_names and n not in _record.CACHE_ARGS]
        bad_inputs = [n for n, a in inputs if _count(a)]
        if bad_inputs:
            origin = (f"its inputs {bad_inputs} already held non-finite values: they came from code between "
                      f"the ops (no earlier op call wrote one)")
        else:
            origin = "its inputs were finite: this op produced them"
        lines = [f"{call.title()} is the first op call that wrote NaN/inf: {', '.join(bad)}; {origin}",
                 "  arguments:"]
        for n, a in zip(call.names, call.args):
            if n in _record.CACHE_ARGS:
                lines.append(f"    {n}: {a.dtype} {list(a.shape)} (cache)")
            else:
                lines.append(f"    {n}: {stats_line(a) if isinstance(a, torch.Tensor) else repr(a)}")
        text = "\n".join(lines)
        with self.lock:
            self.first, self.first_call = text, call.index
        say(self.name, text)
        if self.raise_:
            raise NonFiniteOutputError(text)

    def summary(self) -> str:
        if not self.calls:
            return ""
        parts = ", ".join(f"{op} {n}" for op, n in sorted(self.calls.items()))
        return f"[dlinfer overflow] calls that wrote NaN/inf: {parts} (first: call #{self.first_call})"
