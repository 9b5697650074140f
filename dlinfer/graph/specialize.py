"""A graph traced with symbolic sizes, compiled once per value of the sizes it is told to fix.

Dynamo can trace one graph for several batch sizes (the batch dims marked dynamic), which saves a
trace per size: the trace, Dynamo interpreting the model's Python, is most of what a compile
costs. But such a graph computes its sizes as it runs (`x.size(1)`, `view(1, s0, 960)`), the view
passes cannot collapse chains whose sizes are symbolic, and a call site whose tensors have symbolic
shapes is never bound to a kernel (dlinfer/graph/backend.py): at batch 8 SmolLM2's shared decode
graph spent 2-3x the Python of a graph traced for that size (docs/graph.md).

`PerSizeGraph` keeps the traced graph as Dynamo gave it and, on the first call with new values of
the chosen symbols (the batch sizes; not the sizes that change every step, such as a decode's
longest KV length), compiles a copy in which those symbols are the call's integers
(`specialized`): every size that is a function of them alone becomes a constant in the code, and
every fake value recorded on a node gets the concrete shape, so the passes and call-site bindings
see what they would see in a graph traced for that size. Later calls with the same values run
that copy. Sizes that still depend on a symbol left free (the block table's width) stay symbolic,
as in a graph traced with only those dynamic.

Correct for every call with the same values: a size the copy holds as a constant is an expression
in the fixed symbols alone, and Dynamo's guards (which still run, or which the caller's bucket
choice stands for) keep every call within the graph's assumptions.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

log = logging.getLogger("dlinfer.graph")

_SYM_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat)


def source_name(node: fx.Node) -> Optional[str]:
    """The Python expression Dynamo names a placeholder's source by (`L['attn_metadata'].block_offsets`,
    `L['input_ids'].size()[1]`), or None."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return None
    name = source.name
    return name if isinstance(name, str) else name()


def size_pattern(dynamic_sources: str) -> str:
    """The regular expression of the names Dynamo gives the symbolic ints of these
    `torch.compiler.config.dynamic_sources` entries, each a tensor's dim: `L\\['x'\\]:1` is
    `L['x'].size()[1]`."""
    parts = []
    for entry in dynamic_sources.split(","):
        source, _, dim = entry.partition(":")
        if not dim.isdigit():
            raise ValueError(f"dlinfer graph: dynamic source {entry!r}: expected SOURCE:DIM")
        parts.append(rf"{source}\.size\(\)\[{dim}\]")
    return "|".join(parts)


def fixed_symbols(gm: fx.GraphModule, pattern: str) -> List[Tuple[int, Any]]:
    """(placeholder index, sympy symbol) for each distinct symbol that a symbolic-int placeholder of
    `gm` holds and whose Dynamo source name (`L['input_ids'].size()[1]`) matches `pattern`
    (`re.fullmatch`); the first placeholder of a symbol when several hold it."""
    found: Dict[Any, int] = {}
    for index, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.SymInt):
            continue
        expr = value.node.expr
        name = source_name(node)
        if expr.is_Symbol and name is not None and re.fullmatch(pattern, name) and expr not in found:
            found[expr] = index
    return [(index, symbol) for symbol, index in found.items()]


def _has_symbol(value) -> bool:
    if isinstance(value, _SYM_TYPES):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride(), value.storage_offset()))
    if isinstance(value, (list, tuple)):
        return any(_has_symbol(v) for v in value)
    return False


def _fake(mode, like: torch.Tensor, sizes: List[int], strides: List[int], offset: int) -> torch.Tensor:
    """A fake tensor of `mode` with `like`'s dtype and device and this layout: built from a meta
    tensor directly (a fake-mode `empty` + `as_strided` costs ~20x more, thousands per graph)."""
    from torch._subclasses.fake_tensor import FakeTensor

    span = 1 + sum((s - 1) * st for s, st in zip(sizes, strides)) if all(sizes) else 0
    meta = torch.empty(offset + span, dtype=like.dtype, device="meta").as_strided(sizes, strides, offset)
    return FakeTensor(mode, meta, like.device)


def _plain(value) -> bool:
    """A Python int, bool or float, or a tuple / list of them: what a size computation gives once
    its symbols are fixed, written into the code as a constant."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return type(value) in (int, bool, float)


def _fix(value, subs: Dict[Any, int]):
    """`value` (a fake value Dynamo recorded) with the symbols in `subs` replaced by their integers:
    a symbolic int, bool or float that depends on nothing else becomes a Python one; a fake tensor
    whose sizes, strides and offset all become integers becomes a fake tensor of that layout (same
    fake mode, dtype and device); anything else is returned as it is."""
    if isinstance(value, _SYM_TYPES):
        expr = value.node.expr.xreplace(subs)
        if expr.free_symbols:
            return value
        return {torch.SymInt: int, torch.SymBool: bool, torch.SymFloat: float}[type(value)](expr)
    if isinstance(value, torch.Tensor):
        if not _has_symbol(value):
            return value
        sizes = [_fix(d, subs) for d in value.shape]
        strides = [_fix(d, subs) for d in value.stride()]
        offset = _fix(value.storage_offset(), subs)
        if _has_symbol((sizes, strides, offset)):
            return value
        mode = getattr(value, "fake_mode", None)
        if mode is None:
            return value
        return _fake(mode, value, sizes, strides, offset)
    if isinstance(value, torch.Size):
        return tuple(_fix(v, subs) for v in value)
    if isinstance(value, (list, tuple)):
        return type(value)(_fix(v, subs) for v in value)
    return value


def specialized(gm: fx.GraphModule, subs: Dict[Any, int]) -> fx.GraphModule:
    """A copy of `gm` with the symbols of `subs` fixed to its integers (the module docstring): the
    nodes that computed a size from them alone are gone, their users hold the integer, and every
    node's recorded fake value has the concrete shape. `gm` is left as it is; the copy shares its
    attributes (parameters, buffers) and has the same placeholders, so it is called the same way."""
    import sympy

    subs = {symbol: sympy.Integer(value) for symbol, value in subs.items()}
    graph = copy.deepcopy(gm.graph)  # node metas are copied shallowly: the values are shared
    for node in list(graph.nodes):
        old = node.meta.get("example_value", node.meta.get("val"))
        if not _has_symbol(old):
            continue
        new = _fix(old, subs)
        if node.op in ("call_function", "call_method") and _plain(new):
            constant = list(new) if isinstance(new, list) else new
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda n: constant if n is node else n)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda n: constant if n is node else n)
            if not node.users:
                graph.erase_node(node)
                continue
        node.meta = dict(node.meta)
        node.meta["example_value"] = new
        if "val" in node.meta:
            node.meta["val"] = new
    graph.lint()
    # Lazy: its code is generated once, when compiled, not also here and after the passes.
    from torch.fx._lazy_graph_module import _LazyGraphModule

    out = _LazyGraphModule(gm, graph)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


class PerSizeGraph:
    """The callable a backend returns for a graph with symbols to fix: `graph(*args)` runs the
    copy of the traced graph specialised to this call's values of those symbols, compiled by
    `compile(gm, args)` on the first call with those values (the module docstring).

    symbols: [(placeholder index, sympy symbol)] from `fixed_symbols`.
    A copy that cannot be made (an unexpected node) is logged once and the traced graph itself,
    compiled as it is, serves those values instead."""

    def __init__(self, gm: fx.GraphModule, symbols: Sequence[Tuple[int, Any]],
                 compile: Callable[[fx.GraphModule, Sequence[Any]], Callable]):
        self._traced = gm
        self._indices = [index for index, _ in symbols]
        self._symbols = [symbol for _, symbol in symbols]
        self._compile = compile
        self._graphs: Dict[Tuple[int, ...], Callable] = {}
        self._lock = threading.Lock()
        self._generic: Optional[Callable] = None

    @property
    def sizes(self) -> List[Tuple[int, ...]]:
        """The values the graph has been specialised to so far."""
        return list(self._graphs)

    def __call__(self, *args):
        key = tuple(args[i] for i in self._indices)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._build(key, args)
        return graph(*args)

    def graph_for(self, *args) -> Callable:
        """The compiled copy that `self(*args)` runs (compiled now if it is the first call with
        these values)."""
        key = tuple(args[i] for i in self._indices)
        return self._graphs.get(key) or self._build(key, args)

    def _build(self, key: Tuple[int, ...], args) -> Callable:
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None:
                return graph
            start = time.perf_counter()
            try:
                copy_ = specialized(self._traced, dict(zip(self._symbols, key)))
            except Exception as exc:  # noqa: BLE001 - the traced graph still runs every size
                log.warning("dlinfer graph: could not specialise a graph to sizes %s (%s: %s); "
                            "running it with symbolic sizes", key, type(exc).__name__, exc)
                if self._generic is None:
                    self._generic = self._compile(fx.GraphModule(self._traced, copy.deepcopy(self._traced.graph)),
                                                  args)
                graph = self._generic
            else:
                graph = self._compile(copy_, args)
                log.debug("dlinfer graph: compiled for sizes %s in %.2f s", key, time.perf_counter() - start)
            self._graphs[key] = graph
            return graph
