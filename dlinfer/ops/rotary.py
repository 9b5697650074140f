"""Rotary position embedding (rotate-half form, optionally partial)."""

from __future__ import annotations

from typing import Tuple

from torch import Tensor

from dlinfer.ops import _checks as C
from dlinfer.ops._dispatch import check_dtype, run, vendor_for


def _tokens_heads_dim(op: str, name: str, t) -> Tuple[int, int, int]:
    if isinstance(t, Tensor) and t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    C.tensor(op, name, t, ("T", "H", "D"), C.FLOAT_DTYPES)
    return tuple(t.shape)


def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """Rotate-half rotary embedding over the first R dims of every head; dims R..D pass through.

    query: [T, Hq, D] (or [1, T, Hq, D]); key: [T, Hkv, D] (or [1, T, Hkv, D]); not modified.
    cos, sin: per-token tables with T*R elements, e.g. [T, R], [1, T, R] or [T, 1, R];
        R <= D and even, the two halves duplicated (cos[:, :R/2] == cos[:, R/2:]). Any float dtype;
        the rotation runs in fp32.
    Returns new tensors (q, k) with the shapes and dtypes of query and key:
        out[..., :R] = x[..., :R] * cos + rotate_half(x[..., :R]) * sin,
        rotate_half(x) = cat(-x[..., R/2:], x[..., :R/2]).
    """
    op = "apply_rotary_pos_emb"
    t, hq, d = _tokens_heads_dim(op, "query", query)
    _, hkv, _ = _tokens_heads_dim(op, "key", key)
    q3 = query.reshape(t, hq, d)
    C.tensor(op, "key", key[0] if key.dim() == 4 else key, (t, hkv, d), C.FLOAT_DTYPES, query.device)
    C.same_dtype(op, "key", key, query, "query")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, Tensor) or table.dim() < 1:
            raise C.InvalidArgumentError(op, name, "a tensor [T, R]", C.describe(table))
        C.tensor(op, name, table, ["..."] * table.dim(), C.FLOAT_DTYPES, query.device)
    rot = cos.shape[-1]
    if rot > d or rot % 2 or rot == 0 or cos.numel() != t * rot:
        raise C.InvalidArgumentError(op, "cos", f"{t}*R elements, R = last dim even and <= {d}", C.describe(cos))
    if tuple(sin.shape) != tuple(cos.shape):
        raise C.InvalidArgumentError(op, "sin", f"the shape of cos {list(cos.shape)}", C.describe(sin))
    vendor = vendor_for(op, query.device)
    check_dtype(vendor, op, query.dtype)
    q_out, k_out = run(op, query.device, q3, key.reshape(t, hkv, d), cos.reshape(t, rot), sin.reshape(t, rot))
    return q_out.view(query.shape), k_out.view(key.shape)
