"""SiLU-and-mul in PyTorch."""

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(x: Tensor) -> Tensor:
    """x [N, 2I] -> silu(x[:, :I]) * x[:, I:]  [N, I]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
