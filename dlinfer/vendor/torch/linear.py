"""Linear in PyTorch."""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x [N, K], weight [Nout, K], bias [Nout]? -> [N, Nout]."""
    return F.linear(x, weight, bias)
