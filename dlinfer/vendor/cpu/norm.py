"""rms_norm and add_rms_norm through the C++ kernel (csrc/norm.cpp)."""

import torch
from torch import Tensor

_rms_norm = torch.ops.dlinfer_cpu.rms_norm.default
_add_rms_norm = torch.ops.dlinfer_cpu.add_rms_norm.default


def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """hidden_states [N, H], weight [H] -> [N, H] in hidden_states' dtype."""
    return _rms_norm(hidden_states, weight.float().contiguous(), epsilon)


def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float):
    """([N, H], [N, H], [H]) -> (rms_norm(h + r), h + r); the sum in the activation dtype."""
    return _add_rms_norm(hidden_states, residual, weight.float().contiguous(), epsilon)
