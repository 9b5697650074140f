"""An op's argument checks run natively while torch.compile traces it (docs/graph.md, "LMDeploy
graph mode", its Cost).

Dynamo interprets every bytecode instruction of the Python it traces, and the ops' argument checks
were most of what it interpreted in a decode graph, only to leave nothing in it. So an op keeps
its checks in one function that returns the kernel, and calls it only eagerly:

    kernel = (_check_linear(x, weight, bias) if not torch.compiler.is_compiling()
              else checked("linear", _check_linear, x, weight, bias))

While Dynamo traces, `checked` hands the check to Dynamo's `comptime` (code run at compile time with
the traced frame's locals), which calls it as plain Python on the values the trace knows: tensors as
fake tensors with the real shapes, dtypes and devices, sizes as ints (SymInts where a dimension is
dynamic), constants as they are. A failed check: with fullgraph, torch.compile raises Dynamo's
Unsupported error carrying the check's message (LMDeploy's graph runner then runs the step eagerly,
which raises the error itself); without it, the error itself, as eagerly. Where the native run
cannot decide for sure (below), the check is interpreted by Dynamo as before this module existed.
Nothing here touches Dynamo outside a trace.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dlinfer.errors import InvalidArgumentError, UnsupportedError


def checked(op: str, check: Callable[..., Any], *args: Any) -> Callable:
    """The kernel for `op` after `check(*args)`, for an op called under torch.compiler.is_compiling().

    Under Dynamo: runs the check natively (`_run_check`) and returns `torch.ops.dlinfer.<op>`. When
    the native run sets the local `interpret`, the check runs here again, interpreted by Dynamo: a
    failing one raises, which Dynamo cannot trace, so it runs that part eagerly and the error reaches
    the caller as it would eagerly. (A graph break at the `comptime` call itself would not do:
    Dynamo would run the call eagerly, where it does nothing, and resume after it as if the check
    had passed.) Anywhere else that compiles without Dynamo (torch.export's non-strict mode): the
    check, called as it is.

    args: what the check reads: tensors, numbers, strings, dtypes, devices, None, and tuples or
    lists of those. Any other object reaches the check as an `Opaque` stand-in naming its type (its
    attributes are not known at compile time), so a check reading an object's attributes does not
    belong here.
    """
    if not torch.compiler.is_dynamo_compiling():
        return check(*args)
    interpret = False
    torch._dynamo.comptime.comptime(_run_check)
    if interpret:
        return check(*args)
    return getattr(torch.ops.dlinfer, op)


def _run_check(ctx) -> None:
    """`comptime`'s callback in `checked`'s frame: check(*args) on their compile-time values.

    Sets `checked`'s local `interpret` (the check then runs interpreted) when a failed check is
    allowed to break the graph, and wherever the native run cannot decide for sure: a value with no
    faithful compile-time form (a Python number Dynamo holds as a tensor, a numpy array), a symbolic
    number among the arguments (SymInt, SymFloat: Dynamo's interpreted `isinstance` takes a SymFloat
    for a float, plain Python does not), any other exception (a check reading a tensor's value), or
    Dynamo capturing scalar outputs (a value read natively would make an unbacked symbol outside the
    graph). Under fullgraph, a check that fails on plain values breaks the graph with its message.
    """
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    try:
        if torch._dynamo.config.capture_scalar_outputs:
            raise _NotNative
        check = ctx.get_local("check").as_python_constant()
        args = _value(ctx.get_local("args")._i_will_not_complain_if_bc_breaks_VariableTracker())
        check(*args)
    except (InvalidArgumentError, UnsupportedError) as e:
        strict = tx.one_graph or getattr(tx, "error_on_graph_break", False)  # not in every torch release
        if strict and not any(isinstance(a, _SYMBOLIC) for a in _flat(args)):
            ctx.graph_break(str(e))
        _interpret(tx)
    except Exception:
        _interpret(tx)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _interpret(tx) -> None:
    from torch._dynamo.variables import ConstantVariable

    tx.symbolic_locals["interpret"] = ConstantVariable.create(True)


def _flat(args) -> list:
    """args with one level of tuples and lists opened."""
    return [b for a in args for b in (a if isinstance(a, (tuple, list)) else (a,))]


class _NotNative(Exception):
    """A traced value (or setting) the checks cannot be run natively on."""


class Opaque:
    """A traced value with no compile-time Python equivalent (a user object, a generator): what
    the checks see instead of it, so that a check expecting a tensor or an int rejects it."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


def _value(tracker) -> Any:
    """The compile-time value of one of Dynamo's VariableTrackers (_NotNative: none faithful)."""
    from torch._dynamo.variables.lists import BaseListVariable
    from torch._dynamo.variables.tensor import SymNodeVariable, TensorVariable

    if tracker.is_python_constant():
        return tracker.as_python_constant()
    if isinstance(tracker, TensorVariable):
        if not issubclass(tracker.python_type(), torch.Tensor):  # a number or numpy array held as a tensor
            raise _NotNative
        return tracker.as_proxy().node.meta["example_value"]
    if isinstance(tracker, SymNodeVariable):
        return tracker.sym_num
    if isinstance(tracker, BaseListVariable):
        items = [_value(item) for item in tracker.items]
        return tuple(items) if tracker.python_type() is tuple else items
    return Opaque(tracker.python_type().__name__)
