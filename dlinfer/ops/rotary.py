"""Rotary position embedding (rotate-half form, optionally partial)."""

from __future__ import annotations

from typing import Tuple

from torch import Tensor

from dlinfer.ops import _checks as C
from dlinfer.ops._dispatch import check_dtype, kernel_for


def _three_dims(op: str, name: str, t, dims, device=None) -> Tensor:
    """t as [T, H, D] (a leading batch dim of 1 dropped), checked against dims."""
    if isinstance(t, Tensor) and t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    return C.tensor(op, name, t, dims, C.FLOAT_DTYPES, device)


def _check_table(op: str, name: str, table, device) -> None:
    C.rank_at_least(op, name, table, 1, "[T, R]")
    C.dtype_in(op, name, table, C.FLOAT_DTYPES)
    if table.device != device:
        raise C.InvalidArgumentError(op, name, f"device {device}", C.describe(table))


def _as_rows(table: Tensor, t: int, rot: int) -> Tensor:
    """A cos / sin table with t*R elements as [t, R]."""
    return table if table.dim() == 2 and table.shape[0] == t else table.reshape(t, rot)


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
    q3 = _three_dims(op, "query", query, ("T", "Hq", "D"))
    t, _, d = q3.shape
    device = q3.device
    k3 = _three_dims(op, "key", key, (t, "Hkv", d), device)
    C.same_dtype(op, "key", key, query, "query")
    _check_table(op, "cos", cos, device)
    _check_table(op, "sin", sin, device)
    rot = cos.shape[-1]
    if rot > d or rot % 2 or rot == 0 or cos.numel() != t * rot:
        raise C.InvalidArgumentError(op, "cos", f"{t}*R elements, R = last dim even and <= {d}", C.describe(cos))
    if sin.shape != cos.shape:
        raise C.InvalidArgumentError(op, "sin", f"the shape of cos {list(cos.shape)}", C.describe(sin))
    kernel, vendor = kernel_for(op, device)
    check_dtype(vendor, op, query.dtype)
    q_out, k_out = kernel(q3, k3, _as_rows(cos, t, rot), _as_rows(sin, t, rot))
    return (q_out if q3 is query else q_out.view(query.shape)), (k_out if k3 is key else k_out.view(key.shape))
