"""Helpers shared by the float64 references (reference.py, reference_quant.py), and the norms
(which the quantised norm ops build on)."""

import torch

F64 = torch.float64


def _f64(t):
    return t.detach().to(device="cpu", dtype=F64)


def _ints(t):
    """Any integer tensor (any device) -> list of Python ints."""
    return [int(v) for v in t.detach().cpu().reshape(-1).tolist()]


def _round_half_even(v):
    """float64 tensor -> nearest integers, ties to the even one (spelled out with floor)."""
    f = torch.floor(v)
    d = v - f
    odd = torch.remainder(f, 2) == 1
    return f + ((d > 0.5) | ((d == 0.5) & odd)).to(F64)


def silu(x):
    return x / (1.0 + torch.exp(-x))


# ---------------------------------------------------------------- norms


def rms_norm(hidden_states, weight, epsilon):
    """HF Llama order: normalise (here in f64), round to the activation dtype, then x weight."""
    x = _f64(hidden_states)
    rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    normed = (x / rms).to(hidden_states.dtype).to(F64)
    return normed * _f64(weight)


def add_rms_norm(hidden_states, residual, weight, epsilon):
    """(rms_norm(h + r), h + r); the sum is rounded to the activation dtype (one rounding)."""
    s = (_f64(hidden_states) + _f64(residual)).to(hidden_states.dtype)
    return rms_norm(s, weight, epsilon), _f64(s)
