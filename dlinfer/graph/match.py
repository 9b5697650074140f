"""Recognising nodes of Dynamo's FX graphs: the pattern vocabulary of the rewrite passes.

The passes run on the graph Dynamo hands a backend: torch-level calls (`torch.rsqrt`,
`operator.mul`, `Tensor.pow` as a `call_method`, ...) whose nodes carry a FakeTensor in
`node.meta["example_value"]`. The same computation can be spelled many ways there (`x.pow(2)`,
`torch.pow(x, 2)`, `x ** 2`, `torch.square(x)`; `x.float()` or `x.to(torch.float32)`), so the
passes never compare targets directly: they ask `is_op(node, "mul")` / `binary(node, "mul")` and
get the operands back in one form. Shapes and dtypes come from the fake values, never from guessing.
This module also recognises dtype casts, last-dim slices and halves (slices, `chunk`, `split`) and
calls of dlinfer's own ops. Editing the graph is `dlinfer.graph.edit`'s; in-place writes are
`dlinfer.graph.inplace`'s.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import is_concrete_int

# canonical name -> (call_function targets, call_method names)
_OPS = {
    # out-of-place only: `x += y` (operator.iadd) writes x, which a rewrite must not drop
    "add": ({operator.add, torch.add, torch.Tensor.add}, {"add"}),
    "mul": ({operator.mul, torch.mul, torch.Tensor.mul, torch.multiply}, {"mul", "multiply"}),
    "div": ({operator.truediv, torch.div, torch.true_divide, torch.Tensor.div}, {"div", "true_divide"}),
    "pow": ({operator.pow, torch.pow, torch.Tensor.pow}, {"pow"}),
    "square": ({torch.square, torch.Tensor.square}, {"square"}),
    "mean": ({torch.mean, torch.Tensor.mean}, {"mean"}),
    "rsqrt": ({torch.rsqrt, torch.Tensor.rsqrt}, {"rsqrt"}),
    "sqrt": ({torch.sqrt, torch.Tensor.sqrt}, {"sqrt"}),
    "neg": ({operator.neg, torch.neg, torch.negative, torch.Tensor.neg}, {"neg", "negative"}),
    "cat": ({torch.cat, torch.concat, torch.concatenate}, set()),
    "silu": ({F.silu, torch._C._nn.silu}, set()),
    "sigmoid": ({torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid}, {"sigmoid"}),
    "getitem": ({operator.getitem}, set()),
    "chunk": ({torch.chunk, torch.Tensor.chunk}, {"chunk"}),
    "split": ({torch.split, torch.Tensor.split}, {"split"}),
    "reshape": ({torch.reshape, torch.Tensor.reshape, torch.Tensor.view}, {"reshape", "view"}),
}
_CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type", "type_as"}


def val(node):
    """The fake value Dynamo recorded for `node` (None for constants and unknown nodes)."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return None


def tval(node) -> Optional[torch.Tensor]:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def is_op(node, name: str) -> bool:
    if not isinstance(node, fx.Node):
        return False
    fns, methods = _OPS[name]
    if node.op == "call_function":
        try:
            return node.target in fns
        except TypeError:  # unhashable target
            return False
    return node.op == "call_method" and node.target in methods


def operands(node: fx.Node) -> Tuple[list, dict]:
    """(positional args including self, kwargs) of a call_function or call_method node."""
    return list(node.args), dict(node.kwargs)


def binary(node, name: str) -> Optional[Tuple[object, object]]:
    """(a, b) when `node` computes a <name> b with no extra arguments (alpha, out, rounding)."""
    if not is_op(node, name):
        return None
    args, kwargs = operands(node)
    if "other" in kwargs and len(args) == 1:
        args.append(kwargs.pop("other"))
    if "input" in kwargs and not args:
        args.insert(0, kwargs.pop("input"))
    if len(args) != 2 or kwargs:
        return None
    return args[0], args[1]


def unary(node, name: str):
    """x when `node` computes <name>(x) with no extra arguments."""
    if not is_op(node, name):
        return None
    args, kwargs = operands(node)
    if "input" in kwargs and not args:
        args.append(kwargs.pop("input"))
    if kwargs.get("inplace") is False:
        kwargs.pop("inplace")
    if len(args) != 1 or kwargs:
        return None
    return args[0]


def other_operand(pair, node) -> Optional[object]:
    """The operand of a commutative pair that is not `node` (None if node is not in it)."""
    if pair is None:
        return None
    a, b = pair
    if a is node:
        return b
    if b is node:
        return a
    return None


def is_cast(node) -> bool:
    """A call that changes at most the dtype: x.to(dtype), x.float(), x.type(dtype), ..."""
    if not isinstance(node, fx.Node) or node.op != "call_method" or node.target not in _CAST_METHODS:
        return False
    src, out = tval(node.args[0]) if node.args else None, tval(node)
    return (src is not None and out is not None and src.shape == out.shape and src.device == out.device
            and out.dtype.is_floating_point)


def strip_casts(node):
    """Follow dtype-only casts upward: x.to(float32).to(float32) -> x."""
    while is_cast(node):
        node = node.args[0]
    return node


def same_source(a, b) -> bool:
    """a and b are the same node, or casts of the same node to the same dtype."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    va, vb = tval(a), tval(b)
    return va is not None and vb is not None and va.dtype == vb.dtype and strip_casts(a) is strip_casts(b)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def last_dim_slice(node) -> Optional[Tuple[fx.Node, object, object]]:
    """(x, start, stop) when `node` is x[..., start:stop] (or x[:, :, start:stop] spelled out).

    start / stop are ints (None for an open end) or SymInts; every other dim must be taken whole.
    Also recognises the halves of x.chunk(2, -1) and x.split(n, -1).
    """
    if not is_op(node, "getitem"):
        return None
    base, idx = node.args
    if is_op(base, "chunk") or is_op(base, "split"):
        return _split_piece(base, idx)
    x = tval(base)
    if x is None or x.dim() == 0:
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not idx or not isinstance(idx[-1], slice) or idx[-1].step not in (None, 1):
        return None
    lead = idx[:-1]
    whole = slice(None, None, None)
    if lead == (Ellipsis,) or lead == (whole,) * (x.dim() - 1) or (x.dim() == 1 and lead == ()):
        s = idx[-1]
        return base, _resolve(s.start), _resolve(s.stop)
    return None


def _resolve(bound):
    """A slice bound as an int or None; _UNKNOWN for symbolic or computed bounds."""
    if isinstance(bound, fx.Node):
        bound = val(bound)
    if bound is None or isinstance(bound, int):
        return bound
    if isinstance(bound, torch.SymInt) and is_concrete_int(bound):
        return int(bound)
    return _UNKNOWN


_UNKNOWN = object()


def _split_piece(base: fx.Node, idx) -> Optional[Tuple[fx.Node, object, object]]:
    args, kwargs = operands(base)
    x = args[0] if args else kwargs.get("input", kwargs.get("tensor"))
    xv = tval(x)
    if xv is None or not isinstance(idx, int):
        return None
    second = args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("split_size_or_sections",
                                                                         kwargs.get("split_size")))
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if dim not in (-1, xv.dim() - 1):
        return None
    size = xv.shape[-1]
    if is_op(base, "chunk"):
        if second != 2 or not isinstance(size, int) or size % 2:
            return None
        half = size // 2
    elif isinstance(second, int):
        half = second
    elif isinstance(second, (list, tuple)) and len(second) == 2 and second[0] == second[1]:
        half = second[0]
    else:
        return None
    if not isinstance(half, int) or size != 2 * half:
        return None
    return (x, 0, half) if idx == 0 else (x, half, None) if idx == 1 else None


def half_of(node) -> Optional[Tuple[fx.Node, int]]:
    """(x, 0) if node is the first half of x's last dim, (x, 1) if the second half, else None."""
    got = last_dim_slice(node)
    if got is None:
        return None
    x, start, stop = got
    size = tval(x).shape[-1]
    if not isinstance(size, int) or size % 2 or size == 0:
        return None
    half = size // 2
    if start in (None, 0) and stop in (half, half - size):
        return x, 0
    if start in (half, half - size) and (stop is None or (isinstance(stop, int) and stop >= size)):
        return x, 1
    return None


def dlinfer_op_name(node) -> Optional[str]:
    """<name> when node calls torch.ops.dlinfer.<name> (the packet or an overload), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        qualified = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        qualified = target._qualified_op_name
    else:
        return None
    ns, _, op = qualified.partition("::")
    return op if ns == "dlinfer" else None


def is_dlinfer_op(node, name: Optional[str] = None) -> bool:
    """node calls torch.ops.dlinfer.<name> (any dlinfer op when name is None)."""
    op = dlinfer_op_name(node)
    return op is not None and (name is None or op == name)


def dlinfer_nodes(graph: fx.Graph) -> List[fx.Node]:
    return [n for n in graph.nodes if is_dlinfer_op(n)]
