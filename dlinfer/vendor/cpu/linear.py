"""linear: the few-rows C++ kernel for float32 decode sizes, else the torch vendor's path."""

from typing import Optional

import torch
from torch import Tensor

from dlinfer.vendor.torch import linear as torch_linear

_few_rows = torch.ops.dlinfer_cpu.linear_few_rows.default
MAX_ROWS = torch.ops.dlinfer_cpu.max_few_rows()


def uses_few_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether `linear(x, weight, bias)` runs the C++ kernel (inference only: a call autograd would
    record keeps the torch path)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return (x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.stride(-1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x [N, K], weight [Nout, K], bias [Nout]? -> [N, Nout]."""
    if uses_few_rows(x, weight, bias):
        return _few_rows(x, weight, bias)
    return torch_linear.linear(x, weight, bias)
