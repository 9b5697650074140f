"""Rotary position embedding: rotate-half form (optionally partial), and adjacent-pair (interleaved)."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from dlinfer.ops import _checks as C
from dlinfer.ops._compile_time import checked
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
    kernel = (_check_rotary(query, key, cos, sin) if not torch.compiler.is_compiling()
              else checked("apply_rotary_pos_emb", _check_rotary, query, key, cos, sin))
    q3 = query[0] if query.dim() == 4 else query
    k3 = key[0] if key.dim() == 4 else key
    t, rot = q3.shape[0], cos.shape[-1]
    q_out, k_out = kernel(q3, k3, _as_rows(cos, t, rot), _as_rows(sin, t, rot))
    return (q_out if q3 is query else q_out.view(query.shape)), (k_out if k3 is key else k_out.view(key.shape))


def _check_rotary(query, key, cos, sin):
    """Checks apply_rotary_pos_emb's arguments; returns the vendor's function (`kernel_for`)."""
    op = "apply_rotary_pos_emb"
    q3 = _three_dims(op, "query", query, ("T", "Hq", "D"))
    t, _, d = q3.shape
    device = q3.device
    _three_dims(op, "key", key, (t, "Hkv", d), device)
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
    return kernel


def _drop_unit_dim2(x):
    """LMDeploy's [T, H, 1, D] as [T, H, D]; anything else as it is."""
    if isinstance(x, Tensor) and x.dim() == 4 and x.shape[2] == 1:
        return x.reshape(x.shape[0], x.shape[1], x.shape[3])
    return x


def apply_rotary_pos_emb_interleaved(x: Tensor, cos: Tensor, sin: Tensor, return_native_layout: bool = True) -> Tensor:
    """Adjacent-pair ("interleaved", complex-number) RoPE, as LMDeploy's dlinfer kernel calls it
    (kernels/dlinfer/apply_rotary_pos_emb.py: query and key heads concatenated).

    x: [T, Hq + Hkv, 1, D] (LMDeploy's layout) or [T, H, D]; D even; pairs (x[2i], x[2i+1]).
    cos, sin: [T, 1, 1, D] or [T, D], float, on x's device, in the half layout of Ascend's
        interleave-rope op: entries i and i + D/2 both hold angle i (i < D/2).
    return_native_layout: True: the output in the vendor's front/back-half layout
        (out[..., :D/2] = rotated first members of the pairs, out[..., D/2:] = rotated second
        members); False: adjacent pairs again.
    Returns a new tensor shaped like x, in x's dtype (the rotation in fp32, one rounding):
        a = x[..., 0::2], b = x[..., 1::2], c = cos[..., :D/2], s = sin[..., :D/2]
        a' = a * c - b * s,  b' = b * c + a * s.
    """
    kernel = (_check_interleaved(x, cos, sin, return_native_layout) if not torch.compiler.is_compiling()
              else checked("apply_rotary_pos_emb_interleaved", _check_interleaved, x, cos, sin, return_native_layout))
    x3 = _drop_unit_dim2(x)
    t, _, d = x3.shape
    out = kernel(x3, cos.reshape(t, d), sin.reshape(t, d), return_native_layout)
    return out if x3 is x else out.view(x.shape)


def _check_interleaved(x, cos, sin, return_native_layout):
    """Checks apply_rotary_pos_emb_interleaved's arguments; returns the vendor's function."""
    op = "apply_rotary_pos_emb_interleaved"
    x3 = _drop_unit_dim2(x)
    C.tensor(op, "x", x3, ("T", "H", "D"), C.FLOAT_DTYPES)
    t, _, d = x3.shape
    if d % 2:
        raise C.InvalidArgumentError(op, "x", "an even head dim D", C.describe(x))
    for name, table in (("cos", cos), ("sin", sin)):
        _check_table(op, name, table, x3.device)
        if table.numel() != t * d or table.shape[0] != t or table.shape[-1] != d:
            raise C.InvalidArgumentError(op, name, f"[T={t}, 1, 1, D={d}] or [T, D]", C.describe(table))
    if not isinstance(return_native_layout, bool):
        raise C.InvalidArgumentError(op, "return_native_layout", "a bool", C.describe(return_native_layout))
    kernel, vendor = kernel_for(op, x3.device)
    check_dtype(vendor, op, x3.dtype)
    return kernel
