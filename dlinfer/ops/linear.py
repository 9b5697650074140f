"""Dense linear layer, optionally all-reduced over a process group (tensor parallel row split)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dlinfer.ops import _checks as C
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, kernel_for


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, all_reduce: bool = False, group="") -> Tensor:
    """x @ weight.T + bias, then (when all_reduce) a sum over the process group.

    x: [..., K] float32/float16/bfloat16.
    weight: [N, K], same dtype and device.  bias: [N] or None.
    all_reduce: sum the result over `group` (a torch.distributed ProcessGroup; "" or None means the
        default group). A no-op when torch.distributed is not initialised or the group has one rank.
    Returns a new tensor [..., N].
    """
    kernel = (_check_linear(x, weight, bias) if not torch.compiler.is_compiling()
              else checked("linear", _check_linear, x, weight, bias))
    if x.dim() == 2:
        out = kernel(x, weight, bias)
    else:
        out = kernel(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if all_reduce:
        sum_over_group(out, group)
    return out


def _check_linear(x, weight, bias):
    """Checks linear's arguments; returns the vendor's function (`kernel_for`)."""
    op = "linear"
    C.rank_at_least(op, "x", x, 1, "[..., K]")
    C.dtype_in(op, "x", x, C.FLOAT_DTYPES)
    k = x.shape[-1]
    device = x.device
    C.tensor(op, "weight", weight, ("N", k), C.FLOAT_DTYPES, device)
    C.same_dtype(op, "weight", weight, x, "x")
    if bias is not None:
        C.tensor(op, "bias", bias, (weight.shape[0],), C.FLOAT_DTYPES, device)
        C.same_dtype(op, "bias", bias, x, "x")
    kernel, vendor = kernel_for(op, device)
    check_dtype(vendor, op, x.dtype)
    return kernel


def sum_over_group(out: Tensor, group="") -> None:
    """all_reduce (sum) `out` in place over `group` ("" or None: the default group); a no-op when
    torch.distributed is not initialised or the group has one rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pg = None if group in ("", None) else group
        if dist.get_world_size(pg) > 1:
            dist.all_reduce(out, group=pg)
