"""Common subexpression elimination of per-layer metadata derivations.

Every attention layer of a decode step derives the same canonical metadata from the step's
inputs (`cu_seqlens_q_cpu[1:]`, an int32 cast, a pad to cumulative offsets). Once captured, a
30-layer model computes it 30 times, and each layer hands its op a different tensor, so a
vendor cannot recognise the step's metadata from one layer to the next (the torch vendor builds
its decode plan once per step by tensor identity). Merging the identical nodes fixes both.

Deliberately narrow, so that it can never change a result: a node is merged only when
- its call is in a small allowlist of non-mutating torch calls (indexing, casts, views, pad,
  cumsum, arithmetic), with no `out=`;
- every tensor it reads derives, through allowlisted calls only, from graph inputs that nothing
  in the graph writes (no dlinfer op mutates them, no in-place method, no setitem, no `out=`);
- an earlier node makes the same call on the same (merged) arguments.
Model activations never qualify (they come out of non-allowlisted ops), nor do KV caches (written
by fill_kv_cache).
"""

from __future__ import annotations

import operator
from typing import Dict, Set

import torch
import torch.fx as fx
import torch.nn.functional as F

from dlinfer.graph import inplace

_PURE_FUNCTIONS = {
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
    operator.neg, F.pad, torch._C._nn.pad, torch.cumsum, torch.add, torch.sub, torch.mul,
}
_PURE_METHODS = {
    "to", "int", "long", "float", "contiguous", "view", "reshape", "size", "cumsum", "unsqueeze",
    "squeeze", "flatten", "unflatten", "add", "sub", "mul", "clone", "cpu",
}


def _is_pure_call(node: fx.Node) -> bool:
    if "out" in node.kwargs:
        return False
    if node.op == "call_function":
        try:
            return node.target in _PURE_FUNCTIONS
        except TypeError:
            return False
    return node.op == "call_method" and node.target in _PURE_METHODS


def _flatten_nodes(value) -> list:
    out = []
    fx.node.map_arg(value, out.append)
    return out


def _key(node: fx.Node, rep: Dict[fx.Node, fx.Node]):
    def norm(a):
        if isinstance(a, fx.Node):
            return ("node", id(rep.get(a, a)))
        if isinstance(a, slice):
            return ("slice", norm(a.start), norm(a.stop), norm(a.step))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                          type(Ellipsis))):
            return (type(a).__name__, a)
        raise TypeError  # anything else: not merged

    return (node.op, node.target, norm(node.args), norm(node.kwargs))


def cse_pass(gm: fx.GraphModule) -> int:
    """Merge duplicate metadata derivations (see the module docstring); returns nodes removed."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    # Everything derived from each placeholder through allowlisted calls (over-approximates aliasing).
    derived: Dict[fx.Node, Set[fx.Node]] = {}
    for ph in placeholders:
        seen, stack = {ph}, [ph]
        while stack:
            for user in stack.pop().users:
                if user not in seen and _is_pure_call(user):
                    seen.add(user)
                    stack.append(user)
        derived[ph] = seen
    written = {w for n in graph.nodes for w in inplace.written_args(n)}
    clean = {ph for ph in placeholders if not (derived[ph] & written)}

    eligible: Set[fx.Node] = set(clean)
    rep: Dict[fx.Node, fx.Node] = {}
    first: Dict[tuple, fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if not _is_pure_call(node):
            continue
        inputs = _flatten_nodes((node.args, node.kwargs))
        if not all(i in eligible for i in inputs):
            continue
        eligible.add(node)
        try:
            key = _key(node, rep)
        except TypeError:
            continue
        hit = first.get(key)
        if hit is None:
            first[key] = node
            continue
        rep[node] = hit
        node.replace_all_uses_with(hit)
        graph.erase_node(node)
        removed += 1
    return removed
