"""RMSNorm, with and without a fused residual add."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor
from torch._prims_common import is_contiguous_or_false

from dlinfer.ops import _checks as C
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, kernel_for


def _check_common(op: str, hidden_states, weight, epsilon):
    """Checks what both norms take; returns the vendor's function (`kernel_for`)."""
    C.rank_at_least(op, "hidden_states", hidden_states, 1, "[..., H]")
    C.dtype_in(op, "hidden_states", hidden_states, C.FLOAT_DTYPES)
    C.tensor(op, "weight", weight, (hidden_states.shape[-1],), C.FLOAT_DTYPES, hidden_states.device)
    if not isinstance(epsilon, (float, int)) or isinstance(epsilon, bool) or epsilon < 0:
        raise C.InvalidArgumentError(op, "epsilon", "a float >= 0", C.describe(epsilon))
    kernel, vendor = kernel_for(op, hidden_states.device)
    check_dtype(vendor, op, hidden_states.dtype)
    return kernel


def _check_rms_norm(hidden_states, weight, epsilon):
    return _check_common("rms_norm", hidden_states, weight, epsilon)


def _check_add_rms_norm(hidden_states, residual, weight, epsilon):
    op = "add_rms_norm"
    kernel = _check_common(op, hidden_states, weight, epsilon)
    C.tensor(op, "residual", residual, tuple(hidden_states.shape), C.FLOAT_DTYPES, hidden_states.device)
    C.same_dtype(op, "residual", residual, hidden_states, "hidden_states")
    return kernel


def _rows(t: Tensor, hidden: int) -> Tensor:
    """t [..., H] as [N, H] (itself when already 2-D).

    While torch.compile traces, a tensor not known to be contiguous is copied first: a head-split
    query [1, B, heads, D] (Qwen3's q/k norms) with a symbolic batch B is contiguous only at B = 1,
    and `reshape` (a view or a copy) would ask Dynamo which, a guard that splits the graph LMDeploy's
    runner shares between all batch sizes (docs/graph.md, "LMDeploy graph mode")."""
    if t.dim() == 2:
        return t
    if torch.compiler.is_compiling() and not is_contiguous_or_false(t):
        t = t.clone(memory_format=torch.contiguous_format)
    return t.reshape(-1, hidden)


def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float = 1e-6) -> Tensor:
    """RMSNorm in the HF Llama order: normalise in fp32, cast back, multiply by weight.

    hidden_states: [..., H] float32/float16/bfloat16, not modified.
    weight: [H], same device.
    Returns a new tensor [..., H] in hidden_states' dtype.
    """
    kernel = (_check_rms_norm(hidden_states, weight, epsilon) if not torch.compiler.is_compiling()
              else checked("rms_norm", _check_rms_norm, hidden_states, weight, epsilon))
    out = kernel(_rows(hidden_states, hidden_states.shape[-1]), weight, float(epsilon))
    return out if hidden_states.dim() == 2 else out.view(hidden_states.shape)


def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor,
                 epsilon: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """Fused residual add + RMSNorm.

    hidden_states, residual: [..., H], same shape, dtype and device; not modified.
    weight: [H].
    Returns (rms_norm(hidden_states + residual), hidden_states + residual), the sum computed in the
    activation dtype (as an unfused `h + r` would be), both new tensors [..., H].
    """
    kernel = (_check_add_rms_norm(hidden_states, residual, weight, epsilon) if not torch.compiler.is_compiling()
              else checked("add_rms_norm", _check_add_rms_norm, hidden_states, residual, weight, epsilon))
    hidden = hidden_states.shape[-1]
    normed, added = kernel(_rows(hidden_states, hidden), _rows(residual, hidden), weight, float(epsilon))
    if hidden_states.dim() == 2:
        return normed, added
    return normed.view(hidden_states.shape), added.view(hidden_states.shape)
