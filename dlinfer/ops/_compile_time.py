"""An op's argument checks run natively while torch.compile traces it (docs/graph.md, "LMDeploy
graph mode", its Cost).

Dynamo interprets every bytecode instruction of the Python it traces, and the ops' argument checks
were most of what it interpreted in a decode graph, only to leave nothing in it. So an op keeps
its checks in one function (`_check_linear(x, weight, bias)`: its parameters named as the op's
locals), and while tracing it calls `comptime(runner(check))` instead of the check: Dynamo's
`comptime` runs code at compile time with the traced frame's locals, and `run` calls the check
natively on the values the trace knows (tensors as fake tensors with the real shapes, dtypes and
devices; sizes as ints, or SymInts where a dimension is dynamic; constants as they are):

    if torch.compiler.is_compiling():
        failed = False
        torch._dynamo.comptime.comptime(_linear_at_compile_time)  # = runner(_check_linear)
        kernel = _check_linear(x, weight, bias) if failed else torch.ops.dlinfer.linear
    else:
        kernel = _check_linear(x, weight, bias)

A failed check: with fullgraph, torch.compile raises Dynamo's Unsupported error carrying the
check's message (LMDeploy's graph runner then runs the step eagerly, which raises the error
itself); without it, the error itself, as eagerly (`run`). Nothing here touches Dynamo outside a
trace.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from dlinfer.errors import InvalidArgumentError, UnsupportedError


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


def local_value(ctx, name: str) -> Any:
    """The traced frame's local `name`, as `_value` gives it."""
    var = ctx.get_local(name)
    if var.is_python_constant():
        return var.as_python_constant()
    # ComptimeVar exposes no item access for a tuple holding SymInts or tensors: read the tracker
    return _value(var._ComptimeVar__variable)


def run(ctx, check: Callable[..., Any], names: Sequence[str]) -> None:
    """Call `check` with the traced frame's locals `names`.

    When the check fails: under fullgraph (or error_on_graph_break), a graph break carrying the
    check's message, which torch.compile raises as Dynamo's Unsupported error. Otherwise the traced
    frame's local `failed` becomes True, and the frame goes on into the check's body, whose raise
    Dynamo cannot trace: Dynamo runs that part eagerly, and the InvalidArgumentError reaches the
    caller as it would eagerly. (A graph break at this call would not do: Dynamo would run the
    `comptime` call eagerly, where it does nothing, and resume after it as if the check had passed.)
    """
    try:
        check(*[local_value(ctx, name) for name in names])
    except (InvalidArgumentError, UnsupportedError) as e:
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        if tx.one_graph or getattr(tx, "error_on_graph_break", False):  # not in every torch release
            ctx.graph_break(str(e))
        from torch._dynamo.variables import ConstantVariable

        tx.symbolic_locals["failed"] = ConstantVariable.create(True)


def runner(check: Callable[..., Any]) -> Callable[[Any], None]:
    """The `comptime` callback that runs `check` on the traced frame's locals named as check's
    parameters (an op calls it as `comptime(runner)` while tracing, then `check` itself only if
    the local `failed` came back True)."""
    code = check.__code__
    names = code.co_varnames[:code.co_argcount]

    def at_compile_time(ctx) -> None:
        run(ctx, check, names)

    at_compile_time.__name__ = at_compile_time.__qualname__ = f"{check.__name__}_at_compile_time"
    return at_compile_time
