"""An op's argument checks run natively while torch.compile traces it (docs/graph.md, "LMDeploy
graph mode", its Cost).

Dynamo interprets every bytecode instruction of the Python it traces, and the ops' argument checks
were most of what it interpreted in a decode graph, only to leave nothing in it. So an op keeps
its checks in one function that returns the kernel, and calls it only eagerly:

    kernel = (_check_linear(x, weight, bias) if not torch.compiler.is_compiling()
              else checked("linear", _check_linear, x, weight, bias))

While tracing, `checked` hands the check to Dynamo's `comptime` (code run at compile time with the
traced frame's locals), which calls it as plain Python on the values the trace knows: tensors as
fake tensors with the real shapes, dtypes and devices, sizes as ints (SymInts where a dimension is
dynamic), constants as they are. A failed check: with fullgraph, torch.compile raises Dynamo's
Unsupported error carrying the check's message (LMDeploy's graph runner then runs the step eagerly,
which raises the error itself); without it, the error itself, as eagerly. Nothing here touches
Dynamo outside a trace.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dlinfer.errors import InvalidArgumentError, UnsupportedError


def checked(op: str, check: Callable[..., Any], *args: Any) -> Callable:
    """While tracing: run `check(*args)` natively; return `torch.ops.dlinfer.<op>`.

    args: what the check reads, tensors, numbers, strings, dtypes, devices, None, and tuples or lists
    of those; any other object reaches the check as an `Opaque` stand-in naming its type (its
    attributes are not known at compile time), so a check reading an object's attributes does not
    belong here.

    When the check fails and the trace may break (no fullgraph), `_run_check` sets the local
    `failed`, and the check runs again here, traced: Dynamo cannot trace its raise, so it runs that
    part eagerly and the InvalidArgumentError reaches the caller as it would eagerly. (A graph break
    at the `comptime` call itself would not do: Dynamo would run the call eagerly, where it does
    nothing, and resume after it as if the check had passed.)
    """
    failed = False
    torch._dynamo.comptime.comptime(_run_check)
    if failed:
        return check(*args)
    return getattr(torch.ops.dlinfer, op)


def _run_check(ctx) -> None:
    """`comptime`'s callback in `checked`'s frame: check(*args) on their compile-time values."""
    check = ctx.get_local("check").as_python_constant()
    args = _value(ctx.get_local("args")._ComptimeVar__variable)  # the tracker: ComptimeVar has no item access
    try:
        check(*args)
    except (InvalidArgumentError, UnsupportedError) as e:
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        if tx.one_graph or getattr(tx, "error_on_graph_break", False):  # not in every torch release
            ctx.graph_break(str(e))
        from torch._dynamo.variables import ConstantVariable

        tx.symbolic_locals["failed"] = ConstantVariable.create(True)


class Opaque:
    """A traced value with no compile-time Python equivalent (a user object, a generator): what
    the checks see instead of it, so that a check expecting a tensor or an int rejects it."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


def _value(tracker) -> Any:
    """The compile-time value of one of Dynamo's VariableTrackers."""
    from torch._dynamo.variables.lists import BaseListVariable
    from torch._dynamo.variables.tensor import SymNodeVariable, TensorVariable

    if tracker.is_python_constant():
        return tracker.as_python_constant()
    if isinstance(tracker, TensorVariable):
        return tracker.as_proxy().node.meta["example_value"]
    if isinstance(tracker, SymNodeVariable):
        return tracker.sym_num
    if isinstance(tracker, BaseListVariable):
        items = [_value(item) for item in tracker.items]
        return tuple(items) if tracker.python_type() is tuple else items
    return Opaque(tracker.python_type().__name__)
