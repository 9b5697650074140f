"""In-place writes in Dynamo's FX graphs: which argument nodes a call may write (mutable schema
arguments of torch ops such as dlinfer's caches, `out=`, `inplace=True`, `x.add_()`, `x += y`,
setitem), and every node sharing memory with one through views. The rewrite passes leave such
nodes alone: a fused op placed right after its inputs could read them on the wrong side of a write.
"""

from __future__ import annotations

import operator
from typing import List, Optional

import torch
import torch.fx as fx

_INPLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
}
# Calls whose result may share memory with their first argument.
_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "unsqueeze", "squeeze", "flatten",
    "unflatten", "expand", "expand_as", "contiguous", "to", "float", "half", "bfloat16", "double", "type",
    "type_as", "narrow", "select", "split", "chunk", "unbind", "as_strided", "detach", "movedim", "swapaxes",
}
_VIEW_FUNCTIONS = {
    operator.getitem, torch.reshape, torch.permute, torch.transpose, torch.t, torch.unsqueeze, torch.squeeze,
    torch.flatten, torch.narrow, torch.select, torch.split, torch.chunk, torch.unbind, torch.movedim,
    torch.swapaxes, torch.as_strided, torch.detach,
}


def _schemas(target) -> list:
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, name)._schema for name in target.overloads()]
    return []


def written_args(node: fx.Node) -> List[fx.Node]:
    """Argument nodes `node` may write in place (over-approximated): mutable schema arguments of
    torch ops (dlinfer's caches and outputs), `out=`, `inplace=True`, `x.add_()`, `x += y`, setitem."""
    if node.op not in ("call_function", "call_method"):
        return []
    target, written = node.target, []
    if "out" in node.kwargs:
        written.append(node.kwargs["out"])
    if node.kwargs.get("inplace") is True and node.args:
        written.append(node.args[0])
    for schema in _schemas(target):
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if node.args and (_hashable_in(target, _INPLACE_OPERATORS) or (name.endswith("_") and not name.startswith("__"))):
        written.append(node.args[0])
    found: List[fx.Node] = []
    fx.node.map_arg(written, found.append)
    return found


def _may_alias_input(node: fx.Node) -> Optional[fx.Node]:
    if node.op == "call_method" and node.target in _VIEW_METHODS and node.args:
        base = node.args[0]
    elif node.op == "call_function" and _hashable_in(node.target, _VIEW_FUNCTIONS) and node.args:
        base = node.args[0]
    else:
        return None
    return base if isinstance(base, fx.Node) else None


def _hashable_in(target, table) -> bool:
    try:
        return target in table
    except TypeError:
        return False


def written_aliases(graph: fx.Graph) -> set:
    """Nodes whose memory something in the graph may write: every written argument together with
    all it may alias through views (bases, views of bases, views of views). A rewrite that moves
    the reading of such a node could read it before or after the write: passes leave them alone."""
    parent = {}

    def find(n):
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    for node in graph.nodes:
        base = _may_alias_input(node)
        if base is not None:
            parent[find(node)] = find(base)
    roots = {find(w) for n in graph.nodes for w in written_args(n)}
    return {n for n in graph.nodes if find(n) in roots}
