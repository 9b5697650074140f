"""silu_and_mul through the C++ kernel (csrc/activation.cpp)."""

import torch
from torch import Tensor

_silu_and_mul = torch.ops.dlinfer_cpu.silu_and_mul.default


def silu_and_mul(x: Tensor) -> Tensor:
    """x [N, 2I] -> silu(x[:, :I]) * x[:, I:]  [N, I]."""
    return _silu_and_mul(x)
