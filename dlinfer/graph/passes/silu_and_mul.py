"""SiLU of one half times the other half -> `dlinfer.silu_and_mul`.

Recognised:

    out = F.silu(x[..., :n]) * x[..., n:]         # 2n == x.shape[-1]; operands in any order
    gate, up = x.chunk(2, -1); out = F.silu(gate) * up      # also x.split(n, -1)
    g = x[..., :n]; out = g * torch.sigmoid(g) * x[..., n:]  # silu written out

This is the merged gate/up projection form (Phi-3, LMDeploy's own MLPs, or a model after its
gate and up linears were merged). HF Llama's MLP computes `act_fn(gate_proj(x)) * up_proj(x)`
from two separate linears: there is no [.., 2I] tensor to hand the op, so the pass leaves it
alone rather than concatenating weights inside the graph.

Conditions: both halves come from the same tensor's last dim, split evenly; the result has x's
dtype; the halves and the SiLU are used nowhere else.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from dlinfer.graph import edit, inplace, match

_OP = torch.ops.dlinfer.silu_and_mul.default


def _silu_of(node) -> Optional[tuple]:
    """(input, interior nodes) when node computes silu(input)."""
    x = match.unary(node, "silu")
    if x is not None:
        return x, [node]
    pair = match.binary(node, "mul")
    if pair is None:
        return None
    for a, b in (pair, pair[::-1]):
        if match.unary(b, "sigmoid") is a and len(b.users) == 1:
            return a, [node, b]
    return None


def _match(mul: fx.Node):
    pair = match.binary(mul, "mul")
    if pair is None:
        return None
    for act, other in (pair, pair[::-1]):
        got = _silu_of(act)
        if got is None:
            continue
        gate, act_nodes = got
        g, u = match.half_of(gate), match.half_of(other)
        if g is None or u is None or g[0] is not u[0] or g[1] != 0 or u[1] != 1:
            continue
        x = g[0]
        interior = act_nodes + [gate, other]
        interior += [p.args[0] for p in (gate, other)
                     if match.is_op(p.args[0], "chunk") or match.is_op(p.args[0], "split")]
        interior = list(dict.fromkeys(interior))
        if not edit.only_users_within(interior, interior + [mul]):
            continue
        xv, ov = match.tval(x), match.tval(mul)
        if ov is None or ov.dtype != xv.dtype or xv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            continue
        if tuple(ov.shape) != (*xv.shape[:-1], xv.shape[-1] // 2):
            continue
        return x, interior
    return None


def silu_and_mul_pass(gm: fx.GraphModule) -> int:
    """Rewrite every matching SiLU-and-mul; returns how many were rewritten."""
    graph, count = gm.graph, 0
    written = inplace.written_aliases(graph)
    for mul in [n for n in graph.nodes if match.is_op(n, "mul")]:
        if getattr(mul, "_erased", False):
            continue
        got = _match(mul)
        if got is None or got[0] in written:
            continue
        x, interior = got
        xv = match.tval(x)
        anchor = edit.insertion_anchor(graph, [x], [mul])
        if anchor is None:
            continue
        with graph.inserting_before(anchor.next):
            flat = x if xv.dim() == 2 else edit.call(graph, "reshape", x, -1, xv.shape[-1], method=True)
            out = edit.call(graph, _OP, flat)
            if xv.dim() != 2:
                lead = edit.dims_of(graph, x, range(xv.dim() - 1))
                out = edit.call(graph, "view", out, *lead, xv.shape[-1] // 2, method=True)
        mul.replace_all_uses_with(out)
        edit.erase_dead([mul] + list(reversed(interior)))
        count += 1
    return count
