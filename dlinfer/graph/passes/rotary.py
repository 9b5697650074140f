"""Rotate-half rotary embedding written out in torch calls -> `dlinfer.apply_rotary_pos_emb`.

Recognised (HF `rotate_half` + `apply_rotary_pos_emb`, any layout):

    x1, x2 = x[..., : D // 2], x[..., D // 2 :]   # or x.chunk(2, -1), x.split(D // 2, -1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin   # operands in any order

`cos` / `sin` broadcast against x: along each leading dim they either match x (a token dim) or
have size 1 (a head dim, e.g. the heads of HF's [B, H, S, D] query against cos [B, 1, S, D], or
the batch when cos is [1, 1, S, D]). The fused op wants tokens x heads x D, so x is permuted to
(token dims, head dims, D) and flattened to [T, H, D], cos / sin to [T, D]; the result is
unflattened and permuted back (Inductor folds these views). Two matches sharing cos and sin with
the same token dims (query and key) become one call; a lone match passes x as both.

Conditions: the result has x's dtype and shape (so cos / sin do not widen it), D is even and
static, and the intermediate values are used nowhere else. The fused op rotates in float32 and
casts back, which for float16 / bfloat16 inputs is at least as accurate as the unfused graph.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dlinfer.graph import edit, inplace, match

_OP = torch.ops.dlinfer.apply_rotary_pos_emb.default


@dataclass
class _Match:
    x: fx.Node
    cos: fx.Node
    sin: fx.Node
    out: fx.Node
    interior: List[fx.Node]
    tokens: tuple  # dims of x that index tokens
    heads: tuple  # dims of x along which cos / sin broadcast


def _eq(a, b) -> bool:
    return statically_known_true(a == b)


def _rotate_half_source(cat: fx.Node):
    """x when `cat` is cat((-x2, x1), -1) of x's halves; also the slice nodes."""
    args, kwargs = match.operands(cat)
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    out = match.tval(cat)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or out is None:
        return None
    if dim not in (-1, out.dim() - 1):
        return None
    neg, first = tensors
    second = match.unary(neg, "neg")
    h1, h2 = match.half_of(first), match.half_of(second)
    if h1 is None or h2 is None or h1[0] is not h2[0] or h1[1] != 0 or h2[1] != 1:
        return None
    interior = [neg, first, second]
    for piece in (first, second):  # x.chunk(2, -1) / x.split(n, -1) feed the halves
        base = piece.args[0]
        if match.is_op(base, "chunk") or match.is_op(base, "split"):
            interior.append(base)
    return h1[0], list(dict.fromkeys(interior))


def _layout(x: fx.Node, cos: fx.Node, sin: fx.Node):
    """(token dims, head dims) of x against cos / sin, or None when they do not fit the op."""
    xv, cv, sv = match.tval(x), match.tval(cos), match.tval(sin)
    if None in (xv, cv, sv) or xv.dim() < 2 or cv.dim() > xv.dim() or cv.shape != sv.shape:
        return None
    d = xv.shape[-1]
    if not isinstance(d, int) or d % 2 or not _eq(cv.shape[-1], d):
        return None
    if not (cv.dtype.is_floating_point and sv.dtype.is_floating_point) or cv.device != xv.device:
        return None
    aligned = (1,) * (xv.dim() - cv.dim()) + tuple(cv.shape)
    tokens, heads = [], []
    for i in range(xv.dim() - 1):
        if _eq(aligned[i], xv.shape[i]):
            tokens.append(i)
        elif _eq(aligned[i], 1):
            heads.append(i)
        else:
            return None
    return tuple(tokens), tuple(heads)


def _match(cat: fx.Node) -> Optional[_Match]:
    got = _rotate_half_source(cat)
    if got is None:
        return None
    x, interior = got
    if len(cat.users) != 1:
        return None
    mul_sin = next(iter(cat.users))
    sin = match.other_operand(match.binary(mul_sin, "mul"), cat)
    if not isinstance(sin, fx.Node) or len(mul_sin.users) != 1:
        return None
    out = next(iter(mul_sin.users))
    mul_cos = match.other_operand(match.binary(out, "add"), mul_sin)
    cos = match.other_operand(match.binary(mul_cos, "mul"), x)
    if not isinstance(cos, fx.Node) or cos is sin:
        return None
    interior = interior + [cat, mul_sin, mul_cos]
    if not edit.only_users_within(interior, interior + [out]):
        return None
    xv, ov = match.tval(x), match.tval(out)
    if ov is None or ov.dtype != xv.dtype or ov.shape != xv.shape:
        return None
    if xv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    layout = _layout(x, cos, sin)
    if layout is None:
        return None
    tokens, heads = layout
    if _static_product([xv.shape[i] for i in tokens]) is None and _static_product([xv.shape[i] for i in heads]) is None:
        return None  # one of T, H must be static to flatten x
    return _Match(x, cos, sin, out, interior, tokens, heads)


def _static_product(sizes) -> Optional[int]:
    return math.prod(sizes) if all(isinstance(s, int) for s in sizes) else None


def _perm(m: _Match) -> list:
    return list(m.tokens) + list(m.heads) + [match.tval(m.x).dim() - 1]


def _to_tokens_heads(graph: fx.Graph, m: _Match) -> fx.Node:
    """x -> [T, H, D] (a permute + reshape)."""
    xv = match.tval(m.x)
    perm = _perm(m)
    t = _static_product([xv.shape[i] for i in m.tokens])
    h = _static_product([xv.shape[i] for i in m.heads])
    x = m.x if perm == list(range(xv.dim())) else edit.call(graph, "permute", m.x, *perm, method=True)
    return edit.call(graph, "reshape", x, -1 if t is None else t, -1 if h is None else h, xv.shape[-1], method=True)


def _table(graph: fx.Graph, m: _Match, table: fx.Node) -> fx.Node:
    """cos / sin -> [T, D] in the token order of x's permutation."""
    xv, tv = match.tval(m.x), match.tval(table)
    if tv.dim() < xv.dim():
        table = edit.call(graph, "reshape", table, *((1,) * (xv.dim() - tv.dim())),
                       *edit.dims_of(graph, table, range(tv.dim())), method=True)
    perm = _perm(m)
    if perm != list(range(xv.dim())):
        table = edit.call(graph, "permute", table, *perm, method=True)
    return edit.call(graph, "reshape", table, -1, xv.shape[-1], method=True)


def _back(graph: fx.Graph, m: _Match, flat: fx.Node) -> fx.Node:
    """[T, H, D] -> x's shape and dim order."""
    xv = match.tval(m.x)
    perm = _perm(m)
    y = edit.call(graph, "view", flat, *edit.dims_of(graph, m.x, perm), method=True)
    if perm == list(range(xv.dim())):
        return y
    inverse = [perm.index(i) for i in range(xv.dim())]
    y = edit.call(graph, "permute", y, *inverse, method=True)
    old, new = match.tval(m.out), match.tval(y)
    if old is not None and new is not None and old.is_contiguous() and not new.is_contiguous():
        y = edit.call(graph, "contiguous", y, method=True)
    return y


def _pairable(a: _Match, b: _Match) -> bool:
    if a.cos is not b.cos or a.sin is not b.sin or a.tokens != b.tokens or a.heads != b.heads:
        return False
    av, bv = match.tval(a.x), match.tval(b.x)
    return av.dim() == bv.dim() and all(_eq(av.shape[i], bv.shape[i]) for i in a.tokens)


def _rewrite(graph: fx.Graph, group: List[_Match]) -> bool:
    first = group[0]
    inputs = [m.x for m in group] + [first.cos, first.sin]
    anchor = edit.insertion_anchor(graph, inputs, [m.out for m in group])
    if anchor is None:
        return False
    with graph.inserting_before(anchor.next):
        flats = [_to_tokens_heads(graph, m) for m in group]
        cos, sin = _table(graph, first, first.cos), _table(graph, first, first.sin)
        key = flats[1] if len(flats) > 1 else flats[0]
        fused = edit.call(graph, _OP, flats[0], key, cos, sin)
        results = [_back(graph, m, edit.call(graph, operator.getitem, fused, i)) for i, m in enumerate(group)]
    for m, result in zip(group, results):
        m.out.replace_all_uses_with(result)
        edit.erase_dead([m.out] + list(reversed(m.interior)))
    return True


def rotary_pass(gm: fx.GraphModule) -> int:
    """Rewrite every matching rotary embedding; returns how many tensors were rotated by dlinfer."""
    graph = gm.graph
    written = inplace.written_aliases(graph)
    matches = [m for m in (_match(n) for n in list(graph.nodes) if match.is_op(n, "cat")) if m is not None]
    matches = [m for m in matches if not {m.x, m.cos, m.sin} & written]
    count, used = 0, set()
    for i, a in enumerate(matches):
        if i in used:
            continue
        partner = next((j for j in range(i + 1, len(matches)) if j not in used and _pairable(a, matches[j])), None)
        if partner is not None and _rewrite(graph, [a, matches[partner]]):
            used.update((i, partner))
            count += 2
        elif _rewrite(graph, [a]):
            used.add(i)
            count += 1
    return count
