"""RMSNorm in PyTorch (HF Llama order: normalise in fp32, cast back, then scale).

In float32 the cast is a no-op and the order is torch.rms_norm's: that single call is used.
"""

import torch
from torch import Tensor


def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """hidden_states [N, H], weight [H] -> [N, H] in hidden_states' dtype."""
    dtype = hidden_states.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(hidden_states, (hidden_states.shape[-1],), weight, epsilon)
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x.to(dtype) * weight).to(dtype)


def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float):
    """([N, H], [N, H], [H]) -> (rms_norm(h + r), h + r); the sum in the activation dtype."""
    added = hidden_states + residual
    return rms_norm(added, weight, epsilon), added
