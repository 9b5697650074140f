"""A minimal dlinfer vendor registered through the `dlinfer.vendors` entry point."""

import collections

import torch

from dlinfer.vendor import TOKEN_MAJOR, Capabilities, Vendor

CALLS = collections.Counter()  # op name -> calls that reached this vendor (for tests and demos)


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """hidden_states [N, H], weight [H] -> [N, H] (canonical arguments; already validated)."""
    CALLS["rms_norm"] += 1
    x = hidden_states.float()
    inv_rms = (x.square().sum(-1, keepdim=True) / x.shape[-1] + epsilon).rsqrt()
    return ((x * inv_rms).to(hidden_states.dtype) * weight).to(hidden_states.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] -> [N, I]."""
    CALLS["silu_and_mul"] += 1
    gate, up = x.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def load() -> Vendor:
    return Vendor(
        name="example",
        device_types=("cpu",),
        kv_layouts=(TOKEN_MAJOR,),
        ops={"rms_norm": rms_norm, "silu_and_mul": silu_and_mul},
        capabilities=Capabilities(
            dtypes=(torch.float32, torch.bfloat16),
            features=frozenset(),
            # For `python -m dlinfer conformance --vendor example` (docs/conformance.md): looser
            # (atol, rtol) where this hardware needs them, e.g. {("rms_norm", torch.bfloat16): (0.03, 0.03)},
            # and checks it does not pass, e.g. {"silu_and_mul[*bfloat16*]": "why"}. It needs neither.
            conformance_tolerances={},
            conformance_skips={},
        ),
    )
