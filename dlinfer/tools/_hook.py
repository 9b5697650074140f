"""How the op tools see every op call: one wrapper around each resolved vendor function, and only
while a tool is active (docs/tools.md, "How the tools hook in").

`activate(tool)` installs `_intercept` as the selection's interceptor
(`dlinfer.vendor.selection.set_interceptor`, which clears the resolve cache), so the next call of
each op resolves to a wrapper; `deactivate` of the last active tool removes it, and ops resolve
to the vendor's own functions again: no tool costs anything while none is active. Eager op calls
(`dlinfer.ops.*` -> `kernel_for` -> `resolve`) and `torch.ops.dlinfer.*` custom-op calls (whose
kernel calls `resolve`) both reach the wrapper, with the canonical arguments the vendor gets.

Thread safety: the active tools are one tuple, replaced under a lock and read once per call;
call numbers come from one counter shared by every tool (so "call #N" means the same call in every
report); each tool guards its own statistics.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any, Callable, Dict, Tuple

import torch

from dlinfer.vendor import selection
from dlinfer.vendor.base import Vendor
from dlinfer.vendor.op_table import OPS, OpSpec

_lock = threading.Lock()
_active: Tuple["Tool", ...] = ()
_counter = itertools.count(1)


class OpToolAlarm(RuntimeError):
    """Raised on purpose by a tool (e.g. DLINFER_OP_OVERFLOW=raise); never swallowed."""


def result_names(spec: OpSpec) -> Tuple[str, ...]:
    """How the tools name an op's returned tensors: "result", or "result[i]" for a tuple."""
    returns = spec.schema[spec.schema.rindex("->") + 2:].strip()
    if returns == "()":
        return ()
    if returns.startswith("("):
        return tuple(f"result[{i}]" for i in range(len(returns[1:-1].split(","))))
    return ("result",)


def results_of(result) -> tuple:
    """An op's return value as a tuple of tensors (empty for in-place ops)."""
    if result is None:
        return ()
    if isinstance(result, (tuple, list)):
        return tuple(result)
    return (result,)


class Call:
    """One op call as the vendor function receives it (canonical, positional arguments)."""

    __slots__ = ("index", "op", "vendor", "device_type", "args", "spec", "seconds")

    def __init__(self, index: int, op: str, vendor: str, device_type: str, args: tuple, spec: OpSpec):
        self.index, self.op, self.vendor, self.device_type = index, op, vendor, device_type
        self.args, self.spec = args, spec
        self.seconds = 0.0

    @property
    def names(self) -> Tuple[str, ...]:
        return self.spec.arg_names

    def arg(self, name: str) -> Any:
        return self.args[self.names.index(name)]

    def named(self) -> Dict[str, Any]:
        return dict(zip(self.names, self.args))

    @property
    def device(self) -> torch.device:
        return next((a.device for a in self.args if isinstance(a, torch.Tensor)), torch.device(self.device_type))

    def title(self) -> str:
        return f"call #{self.index} {self.op} (vendor {self.vendor})"


class Tool:
    """Base of the op tools. A tool is a context manager (`with tool: ...` activates it) and can be
    started and stopped explicitly. `before(call)` runs before the vendor function and returns a
    state (None: the tool skips this call), `after(call, result, state)` after it."""

    name = "tool"
    sync = False  # True: CUDA is synchronised around the vendor function (timing)

    def __init__(self, ops=None):
        self.ops = None if ops is None else frozenset(ops)
        unknown = sorted(self.ops - set(OPS)) if self.ops else []
        if unknown:
            raise ValueError(f"dlinfer.tools.{self.name}: unknown ops {unknown}; known: {sorted(OPS)}")
        self.verbose = False  # started from the environment: print a summary when stopped
        self.lock = threading.Lock()

    def wants(self, call: Call) -> bool:
        return self.ops is None or call.op in self.ops

    def before(self, call: Call):
        return True

    def after(self, call: Call, result, state) -> None:
        pass

    def summary(self) -> str:
        return ""

    def close(self) -> None:
        pass

    def start(self) -> "Tool":
        activate(self)
        return self

    def stop(self) -> None:
        deactivate(self)
        self.close()
        if self.verbose:
            text = self.summary()
            if text:
                print(text, file=sys.stderr, flush=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def say(tool: str, message: str) -> None:
    """A tool's message: one block on stderr, flushed (a server's log keeps it)."""
    print(f"[dlinfer {tool}] {message}", file=sys.stderr, flush=True)


def active() -> Tuple[Tool, ...]:
    return _active


def activate(tool: Tool) -> None:
    global _active
    with _lock:
        if tool in _active:
            return
        _active = _active + (tool,)
        if len(_active) == 1:
            selection.set_interceptor(_intercept)


def deactivate(tool: Tool) -> None:
    global _active
    with _lock:
        if tool not in _active:
            return
        _active = tuple(t for t in _active if t is not tool)
        if not _active:
            selection.set_interceptor(None)


def _failed(tool: Tool, exc: BaseException) -> None:
    say(tool.name, f"stopped: it failed with {type(exc).__name__}: {exc} (the op calls go on without it)")
    deactivate(tool)


def _bind(spec: OpSpec, args: tuple, kwargs: dict) -> tuple:
    names = spec.arg_names
    full = list(args) + [None] * (len(names) - len(args))
    for name, value in kwargs.items():
        full[names.index(name)] = value
    return tuple(full)


def _capturing_cuda_graph(device_type: str) -> bool:
    return device_type == "cuda" and torch.cuda.is_current_stream_capturing()


def _intercept(op: str, device_type: str, fn: Callable, vendor: Vendor) -> Callable:
    """The selection's interceptor: `fn` wrapped so that every active tool sees its calls."""
    spec = OPS[op]
    vendor_name = vendor.name

    def run(*args, **kwargs):
        tools = _active
        # Tools copy, compare and synchronise: never inside a CUDA graph being captured.
        if not tools or _capturing_cuda_graph(device_type):
            return fn(*args, **kwargs)
        if kwargs:
            args, kwargs = _bind(spec, args, kwargs), {}
        call = Call(next(_counter), op, vendor_name, device_type, args, spec)
        states = []
        for tool in tools:
            if not tool.wants(call):
                continue
            try:
                state = tool.before(call)
            except OpToolAlarm:
                raise
            except Exception as exc:  # a tool's failure (disk full, ...) must not stop the engine
                _failed(tool, exc)
                continue
            if state is not None:
                states.append((tool, state))
        sync = device_type == "cuda" and any(tool.sync for tool, _ in states)
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(*args)
        if sync:
            torch.cuda.synchronize()
        call.seconds = time.perf_counter() - start
        for tool, state in states:
            try:
                tool.after(call, result, state)
            except OpToolAlarm:
                raise
            except Exception as exc:
                _failed(tool, exc)
        return result

    run.__name__ = f"{op}__dlinfer_tools"
    run.__qualname__ = run.__name__
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def describe(value) -> Any:
    """A JSON-friendly description of an argument: "float32[4, 576]" for a tensor, else the value."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def stats_line(t: torch.Tensor, limit: int = 16) -> str:
    """A tensor's values in one line: small integer tensors in full, floats as statistics."""
    head = describe(t)
    if t.numel() == 0:
        return f"{head} (empty)"
    if not t.is_floating_point():
        flat = t.detach().reshape(-1)
        values = flat[:limit].tolist()
        more = f" ... ({t.numel()} values)" if t.numel() > limit else ""
        return f"{head} {values}{more}"
    x = t.detach().to("cpu", torch.float64)
    finite = torch.isfinite(x)
    n_nan, n_inf = int(x.isnan().sum()), int(x.isinf().sum())
    body = x[finite]
    if body.numel():
        stats = (f"min {float(body.min()):.4g} max {float(body.max()):.4g} mean {float(body.mean()):.4g} "
                 f"absmax {float(body.abs().max()):.4g}")
    else:
        stats = "no finite value"
    extra = f", {n_nan} NaN, {n_inf} inf" if n_nan or n_inf else ""
    return f"{head} {stats}{extra}"
