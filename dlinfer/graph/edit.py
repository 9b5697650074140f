"""Editing Dynamo's FX graphs for the rewrite passes: whether a matched pattern's interior may be
erased, where its replacement may go (after every input, before every user of every output), new
call nodes with the fake value Dynamo would have recorded, symbolic sizes as `size` calls, and
erasing what the rewrite left without users.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.fx as fx

from dlinfer.graph.match import tval, val


def only_users_within(nodes: Iterable[fx.Node], allowed: Iterable[fx.Node]) -> bool:
    """Every user of every node in `nodes` is in `allowed` (interior nodes may be erased)."""
    allowed = set(allowed)
    return all(user in allowed for n in nodes for user in n.users)


def order(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def insertion_anchor(graph: fx.Graph, inputs: Sequence, outputs: Sequence[fx.Node],
                     ranks: Optional[dict] = None) -> Optional[fx.Node]:
    """A node after which replacement nodes may go: after every input node, before every user of
    every output. None when no such place exists."""
    ranks = ranks if ranks is not None else order(graph)
    input_nodes = [n for n in inputs if isinstance(n, fx.Node)]
    input_nodes += [n for n in graph.find_nodes(op="placeholder")][-1:]  # keep placeholders first
    if not input_nodes:
        return None
    last_input = max(input_nodes, key=ranks.__getitem__)
    users = [u for out in outputs for u in out.users]
    if users and min(ranks[u] for u in users) <= ranks[last_input]:
        return None
    return last_input


def set_meta(node: fx.Node) -> None:
    """Give a new node the fake value Dynamo would have recorded (best effort)."""
    fake_mode = None

    def to_fake(a):
        nonlocal fake_mode
        if isinstance(a, fx.Node):
            v = val(a)
            if v is None:
                raise LookupError(a)
            if fake_mode is None and isinstance(v, torch.Tensor):
                fake_mode = getattr(v, "fake_mode", None)
            return v
        return a

    try:
        args = fx.node.map_aggregate(node.args, to_fake)
        kwargs = fx.node.map_aggregate(node.kwargs, to_fake)
        if fake_mode is None:
            return
        with fake_mode:
            if node.op == "call_method":
                out = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                out = node.target(*args, **kwargs)
        node.meta["example_value"] = out
    except Exception:  # noqa: BLE001 - metadata is a convenience for later passes and vendors
        pass


def call(graph: fx.Graph, target, *args, method: bool = False, **kwargs) -> fx.Node:
    node = graph.call_method(target, args, kwargs) if method else graph.call_function(target, args, kwargs)
    set_meta(node)
    return node


def dims_of(graph: fx.Graph, x: fx.Node, dims: Iterable[int]) -> list:
    """Sizes of x at `dims`, as ints where static and as `x.size(d)` nodes where symbolic."""
    shape = tval(x).shape
    return [s if isinstance(s, int) else call(graph, "size", x, d, method=True) for d, s in
            ((d, shape[d]) for d in dims)]


def erase_dead(nodes: Iterable[fx.Node]) -> None:
    """Erase the given nodes once they have no users (last first)."""
    pending = [n for n in dict.fromkeys(nodes) if not getattr(n, "_erased", False)]
    progress = True
    while pending and progress:
        progress = False
        for n in list(pending):
            if not n.users:
                n.graph.erase_node(n)
                pending.remove(n)
                progress = True
