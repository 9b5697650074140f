"""Split a fused projection into heads with two view calls instead of one per piece, plus one.

LMDeploy's attention layers split the fused qkv projection's output along its last dim and give
each piece its heads: `q, k, v = qkv.split((576, 192, 192), -1)` then `q.unflatten(-1, (9, 64))`
and the same for k and v. When the graph runs as Python (the `direct` compiler) that is four
calls into ATen a layer, the split alone (three tensors made) ~2.6 us on the Zen 5 VM and each
unflatten ~1 us. The same views come from giving the whole last dim its heads first and splitting
the heads: `qkv.unflatten(-1, (15, 64)).split((9, 3, 3), -2)`, two calls.

The rule, checked on the fake values Dynamo recorded:
- `x.split(sizes, dim)` along x's last dim (sizes a sequence of ints), x's last dim dense
  (stride 1), every piece used only as `piece.unflatten(-1, (h, D))` (one user, the getitem's),
  D the same for every piece and h * D the piece's size.
Then piece i of the new split is [..., h_i, D] at strides (..., D, 1) from offset
x.offset + D * (h_0 + ... + h_{i-1}): the old unflattened piece (same shape, storage, offset and
strides, but for dims of size 1, whose stride addresses nothing: ATen's view picks another
there), so results and aliasing are unchanged.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Tuple

import torch.fx as fx

from dlinfer.graph import edit
from dlinfer.graph.match import tval


def _split_sizes(node: fx.Node) -> Optional[Tuple[fx.Node, Tuple[int, ...]]]:
    """(x, sizes) when `node` is x.split(sizes, dim) along x's last dim with a dense last dim."""
    if node.op != "call_method" or node.target != "split" or not node.args:
        return None
    x = node.args[0]
    sizes = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    xv = tval(x) if isinstance(x, fx.Node) else None
    if xv is None or xv.dim() == 0 or not isinstance(sizes, (tuple, list)):
        return None
    if not all(isinstance(s, int) for s in sizes) or not isinstance(dim, int):
        return None
    if dim not in (-1, xv.dim() - 1) or xv.stride(-1) != 1 or sum(sizes) != xv.shape[-1]:
        return None
    return x, tuple(sizes)


def _unflatten_heads(piece: fx.Node) -> Optional[Tuple[fx.Node, int, int]]:
    """(unflatten node, h, D) when the getitem `piece` is used only as piece.unflatten(-1, (h, D))."""
    if len(piece.users) != 1:
        return None
    (user,) = piece.users
    if user.op != "call_method" or user.target != "unflatten" or len(user.args) != 3 or user.kwargs:
        return None
    dim, shape = user.args[1], user.args[2]
    if dim != -1 or not isinstance(shape, (tuple, list)) or len(shape) != 2:
        return None
    h, d = shape
    if not (isinstance(h, int) and isinstance(d, int) and h > 0 and d > 0):
        return None
    return user, h, d


def _pieces(split: fx.Node, count: int) -> Optional[List[fx.Node]]:
    """The getitem users of `split`, by index, when they are all its users and one per index."""
    got = {}
    for user in split.users:
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        index = user.args[1] % count if -count <= user.args[1] < count else None
        if index is None or index in got:
            return None
        got[index] = user
    return [got[i] for i in range(count)] if len(got) == count else None


def _rewrite(graph: fx.Graph, split: fx.Node, x: fx.Node, sizes: Sequence[int]) -> bool:
    pieces = _pieces(split, len(sizes))
    if pieces is None:
        return False
    heads = [_unflatten_heads(p) for p in pieces]
    if any(h is None for h in heads):
        return False
    d = heads[0][2]
    if any(hd != d or h * d != size for (_, h, hd), size in zip(heads, sizes)):
        return False
    counts = tuple(h for _, h, _ in heads)
    with graph.inserting_before(split):
        whole = graph.call_method("unflatten", (x, -1, (sum(counts), d)))
        new_split = graph.call_method("split", (whole, counts, -2))
    whole.meta["val"] = tval(x).unflatten(-1, (sum(counts), d))
    new_split.meta["val"] = whole.meta["val"].split(counts, -2)
    for i, (unflatten, _, _) in enumerate(heads):
        with graph.inserting_before(split):
            head = graph.call_function(operator.getitem, (new_split, i))
        head.meta = {**unflatten.meta, "val": new_split.meta["val"][i]}
        unflatten.replace_all_uses_with(head)
    edit.erase_dead([h[0] for h in heads] + pieces + [split])
    return True


def split_heads_pass(gm: fx.GraphModule) -> int:
    """Rewrite every split-then-unflatten of gm's graph as unflatten-then-split (module docstring);
    returns how many splits were rewritten."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        found = _split_sizes(node)
        if found is not None and _rewrite(graph, node, *found):
            done += 1
    return done

