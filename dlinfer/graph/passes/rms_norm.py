"""RMSNorm written out in torch calls -> `dlinfer.rms_norm`; an add feeding it -> `dlinfer.add_rms_norm`.

Recognised (HF LlamaRMSNorm and its spellings):

    xf = x.to(torch.float32)                      # optional (required unless x is float32)
    var = xf.pow(2).mean(-1, keepdim=True)        # or xf * xf, xf ** 2, torch.square(xf)
    y = xf * torch.rsqrt(var + eps)               # or xf / torch.sqrt(var + eps)
    out = weight * y.to(x.dtype)                  # cast optional; either operand order

It is replaced only when the fused op computes the same thing: the normalisation runs in
float32, `weight` is a [H] tensor of x's dtype, the result has x's dtype and shape, `eps` is a
number, and no intermediate value is used outside the pattern. `dlinfer.rms_norm` normalises in
float32, casts back, then multiplies by the weight: the order above.

The second pass fuses `s = h + r` feeding a `dlinfer.rms_norm` (written by the first pass or by
the model itself through `dlinfer.ops.rms_norm`, possibly through a reshape) into one
`dlinfer.add_rms_norm(h, r, weight, eps) -> (normed, s)`; other users of `s` read the fused sum.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dlinfer.graph import edit, inplace, match

_OP = torch.ops.dlinfer.rms_norm.default
_ADD_OP = torch.ops.dlinfer.add_rms_norm.default


def _square_of(node) -> Optional[fx.Node]:
    pair = match.binary(node, "pow")
    if pair is not None:
        return pair[0] if pair[1] == 2 and isinstance(pair[0], fx.Node) else None
    sq = match.unary(node, "square")
    if sq is not None:
        return sq
    pair = match.binary(node, "mul")
    if pair is not None and match.same_source(pair[0], pair[1]):
        return pair[0]
    return None


def _mean_last_keepdim(node):
    if not match.is_op(node, "mean"):
        return None
    args, kwargs = match.operands(node)
    x = args[0] if args else kwargs.pop("input", None)
    dim = args[1] if len(args) > 1 else kwargs.pop("dim", None)
    keepdim = args[2] if len(args) > 2 else kwargs.pop("keepdim", False)
    kwargs.pop("input", None)
    if kwargs or len(args) > 3 or keepdim is not True:
        return None
    xv = match.tval(x)
    if xv is None or xv.dim() == 0:
        return None
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return x if dim in (-1, xv.dim() - 1) else None


def _single_user(node) -> Optional[fx.Node]:
    return next(iter(node.users)) if isinstance(node, fx.Node) and len(node.users) == 1 else None


def _match(mean: fx.Node):
    """Match the pattern around a mean node; returns (x, weight, eps, out, interior) or None."""
    sq = mean.args[0] if mean.args else mean.kwargs.get("input")
    xf = _square_of(sq)
    if xf is None or _mean_last_keepdim(mean) is not sq:
        return None
    add = _single_user(mean)
    eps = match.other_operand(match.binary(add, "add"), mean)
    if not match.is_number(eps) or eps < 0:
        return None
    inv = _single_user(add)
    scaled = _single_user(inv)
    if match.unary(inv, "rsqrt") is add:
        xf2 = match.other_operand(match.binary(scaled, "mul"), inv)
    elif match.unary(inv, "sqrt") is add:
        pair = match.binary(scaled, "div")
        xf2 = pair[0] if pair is not None and pair[1] is inv else None
    else:
        return None
    if xf2 is None or not match.same_source(xf2, xf):
        return None
    cast_back = _single_user(scaled)
    y = cast_back if match.is_cast(cast_back) else scaled
    out = _single_user(y)
    weight = match.other_operand(match.binary(out, "mul"), y)
    if not isinstance(weight, fx.Node):
        return None
    x = match.strip_casts(xf)
    interior = [sq, mean, add, inv, scaled] + ([cast_back] if y is cast_back else [])
    interior += [n for n in {xf, xf2} if n is not x]
    if not _types_ok(x, xf, weight, out):
        return None
    if not edit.only_users_within(interior, interior + [out]):
        return None
    return x, weight, float(eps), out, interior


def _hidden(x, weight) -> Optional[int]:
    """H as a static int: x's last dim, or the weight's size when x's is symbolic but equal to it."""
    xv, wv = match.tval(x), match.tval(weight)
    if xv is None or wv is None or xv.dim() == 0 or wv.dim() != 1 or not isinstance(wv.shape[0], int):
        return None
    return wv.shape[0] if statically_known_true(xv.shape[-1] == wv.shape[0]) else None


def _types_ok(x, xf, weight, out) -> bool:
    xv, xfv, wv, ov = match.tval(x), match.tval(xf), match.tval(weight), match.tval(out)
    if None in (xv, xfv, wv, ov) or _hidden(x, weight) is None:
        return False
    return (xfv.dtype == torch.float32 and xv.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and wv.dtype == xv.dtype and ov.dtype == xv.dtype and ov.dim() == xv.dim()
            and all(statically_known_true(a == b) for a, b in zip(ov.shape, xv.shape))
            and wv.device == xv.device)


def _flatten(graph: fx.Graph, x: fx.Node, hidden: int) -> fx.Node:
    return x if match.tval(x).dim() == 2 else edit.call(graph, "reshape", x, -1, hidden, method=True)


def _unflatten(graph: fx.Graph, flat: fx.Node, like: fx.Node) -> fx.Node:
    return flat if match.tval(like).dim() == 2 else edit.call(graph, "view_as", flat, like, method=True)


def rms_norm_pass(gm: fx.GraphModule) -> int:
    """Rewrite every matching RMSNorm; returns how many were rewritten."""
    graph, count = gm.graph, 0
    written = inplace.written_aliases(graph)
    for mean in [n for n in graph.nodes if match.is_op(n, "mean")]:
        if getattr(mean, "_erased", False):
            continue
        got = _match(mean)
        if got is None:
            continue
        x, weight, eps, out, interior = got
        if x in written or weight in written:
            continue
        anchor = edit.insertion_anchor(graph, [x, weight], [out])
        if anchor is None:
            continue
        with graph.inserting_before(anchor.next):
            flat = _flatten(graph, x, _hidden(x, weight))
            normed = edit.call(graph, _OP, flat, weight, eps)
            result = _unflatten(graph, normed, x)
        out.replace_all_uses_with(result)
        edit.erase_dead([out] + list(reversed(interior)))
        count += 1
    return count


def _through_reshapes(node):
    """(source, chain) following single-user reshape/view nodes upward from `node`."""
    chain = []
    while match.is_op(node, "reshape") and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return node, chain


def _norm_args(norm: fx.Node):
    names = ("hidden_states", "weight", "epsilon")
    args = list(norm.args) + [norm.kwargs[k] for k in names[len(norm.args):] if k in norm.kwargs]
    return args if len(args) == 3 else None


def add_rms_norm_pass(gm: fx.GraphModule) -> int:
    """Fuse a residual add into the dlinfer.rms_norm it feeds; returns how many were fused."""
    graph, count = gm.graph, 0
    written = inplace.written_aliases(graph)
    for norm in [n for n in graph.nodes if match.is_dlinfer_op(n, "rms_norm")]:
        args = _norm_args(norm)
        if args is None:
            continue
        src, weight, eps = args
        added, chain = _through_reshapes(src)
        pair = match.binary(added, "add")
        if pair is None or not all(isinstance(p, fx.Node) for p in pair):
            continue
        h, r = pair
        if {h, r, weight, added} & written:
            continue
        hv, rv, sv, wv = match.tval(h), match.tval(r), match.tval(added), match.tval(weight)
        hidden = _hidden(added, weight)
        if None in (hv, rv, sv, wv) or hidden is None or not (hv.dtype == rv.dtype == sv.dtype == wv.dtype):
            continue
        if not (hv.dim() == rv.dim() == sv.dim() and all(
                statically_known_true(a == b) and statically_known_true(a == c)
                for a, b, c in zip(sv.shape, hv.shape, rv.shape))):
            continue  # h + r must not broadcast
        ranks = edit.order(graph)
        if isinstance(weight, fx.Node) and ranks[weight] > ranks[added]:
            continue
        with graph.inserting_before(added.next):  # every user of the sum comes after it
            fused = edit.call(graph, _ADD_OP, _flatten(graph, h, hidden), _flatten(graph, r, hidden), weight, eps)
            normed = edit.call(graph, operator.getitem, fused, 0)
            summed = _unflatten(graph, edit.call(graph, operator.getitem, fused, 1), h)
        norm.replace_all_uses_with(normed)
        graph.erase_node(norm)
        edit.erase_dead(chain)
        added.replace_all_uses_with(summed)
        edit.erase_dead([added])
        count += 1
    return count
