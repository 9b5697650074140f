"""Collapse chains of views over dense memory: one `view` per chain, none when it changes nothing.

The model code around LMDeploy's layers reshapes every op's inputs and outputs for its own
conventions: `xq.view(1, 1, 576).reshape(1, 576)` between a norm and a linear, `out.view(1, 1, 960)
.flatten(0, -2)` after it, `scale.reshape(960)` on a parameter that already has that shape. In a
captured 30-layer decode graph that is about 1,100 view-like calls a step around 360 kernel calls,
each a Python call into ATen when the graph runs as Python (the `direct` compiler). They compute
nothing: every one reinterprets the same dense memory.

The rule, checked on the fake values Dynamo recorded (never on guesses):
- a chain is view-like calls (`view`, `reshape`, `flatten`, `unflatten`, `squeeze`, `unsqueeze`,
  and `x[...]` / `x[:]`-style indexing that selects everything), each one's input and output
  contiguous, of one dtype, with static sizes and the storage offset of the chain's root;
- a chain whose end has the root's shape is the root itself: its users read the root;
- otherwise its end becomes `root.view(end shape)`, one call.
Over contiguous memory at a fixed offset, any such chain and the single view address the same
bytes in the same order, so results and aliasing (writes through the view reach the root, as
before) are unchanged. A reshape of non-contiguous memory (which copies) or a dtype view is never
a link, so no copy is ever turned into an alias.
"""

from __future__ import annotations

import operator
from typing import List, Optional

import torch
import torch.fx as fx

from dlinfer.graph import edit
from dlinfer.graph.match import tval

_VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze"}
_VIEW_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze,
                   torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.unflatten}


def _select_all(index) -> bool:
    """An index that keeps every element in place: `...`, `:` or `:n` past the end, per dim."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is Ellipsis or (isinstance(p, slice) and p.start in (None, 0) and p.step in (None, 1)
                                 and (p.stop is None or isinstance(p.stop, int)))
               for p in parts)


def _is_view_call(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return len(node.args) == 2 and _select_all(node.args[1])
    try:
        return node.target in _VIEW_FUNCTIONS
    except TypeError:  # unhashable target
        return False


def _dense(t: Optional[torch.Tensor]) -> bool:
    """A fake tensor with static sizes whose elements lie contiguously in memory."""
    return (isinstance(t, torch.Tensor) and all(isinstance(s, int) for s in t.shape)
            and isinstance(t.storage_offset(), int) and t.is_contiguous())


def _link(node: fx.Node, end: torch.Tensor) -> Optional[fx.Node]:
    """node's input when `node` is a view-like call that keeps `end`'s memory (dense, same dtype,
    same numel and offset: a narrowing slice changes the numel or the offset), else None."""
    if not _is_view_call(node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src, out = tval(node.args[0]), tval(node)
    if not (_dense(src) and _dense(out)):
        return None
    same = (src.dtype == out.dtype == end.dtype and src.numel() == out.numel() == end.numel()
            and src.storage_offset() == out.storage_offset() == end.storage_offset())
    return node.args[0] if same else None


def view_chain_pass(gm: fx.GraphModule) -> int:
    """Rewrite every view chain of gm's graph as at most one view (see the module docstring);
    returns how many view calls the graph lost."""
    graph = gm.graph
    before = sum(_is_view_call(n) for n in graph.nodes)
    touched: List[fx.Node] = []
    for node in list(graph.nodes):
        end = tval(node)
        root, chain = node, []
        while (src := _link(root, end)) is not None:  # _link checks `end` itself on the first step
            chain.append(root)
            root = src
        if not chain:
            continue
        shape = tuple(tval(root).shape)
        if shape == tuple(end.shape):
            node.replace_all_uses_with(root)
        elif len(chain) > 1:
            with graph.inserting_before(node):
                single = graph.call_method("view", (root, tuple(end.shape)))
            single.meta = dict(node.meta)
            node.replace_all_uses_with(single)
        else:
            continue  # already one view
        touched.extend(chain)
    edit.erase_dead(reversed(touched))
    return before - sum(_is_view_call(n) for n in graph.nodes)
