"""Linear: the platform matmul (torch.nn.functional.linear -> cuBLAS/cuBLASLt on CUDA).

A hand-written Triton GEMM would not beat cuBLAS for dense [N, K] x [K, Nout] shapes, so this op
is deliberately not a Triton kernel; the vendor's capability notes say so.
"""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x [N, K], weight [Nout, K], bias [Nout]? -> [N, Nout]."""
    return F.linear(x, weight, bias)
