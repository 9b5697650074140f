"""Linear in PyTorch.

On CPU, float32 goes to oneDNN's inner-product primitive (`torch.ops.mkldnn._linear_pointwise`,
the kernel Inductor's CPU backend calls) instead of `F.linear`, whose float32 path is MKL's
sgemm: over SmolLM2's 120 decode-time projections oneDNN streams the weights about 1.5x faster at
1 and 8 rows (`benchmarks/bench_cpu_ops.py`, the torch column against `x @ w.t()`;
docs/benchmarks.md). bfloat16/float16 `F.linear` is oneDNN already. `DLINFER_CPU_LINEAR=aten`
turns the oneDNN path off; so does a torch built without oneDNN. Both paths are float32 GEMMs
with float32 accumulation (different summation orders). (The cpu vendor goes further at these
sizes with its own kernel, and uses this function beyond 8 rows.)
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dlinfer import envs


@functools.lru_cache(maxsize=None)
def _onednn_enabled() -> bool:
    """DLINFER_CPU_LINEAR, read at the first float32 CPU call (not at import: a bad value must not
    keep the vendor from loading). An unknown value warns and keeps the default."""
    choice = (envs.get("DLINFER_CPU_LINEAR") or "onednn").lower()
    if choice not in ("onednn", "aten"):
        warnings.warn(f"dlinfer: DLINFER_CPU_LINEAR must be 'onednn' or 'aten', got {choice!r}; using 'onednn'",
                      stacklevel=2)
        choice = "onednn"
    return (choice == "onednn" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear(x, weight, ...)` runs on oneDNN's float32 inner product (inference only:
    a call that autograd would record keeps `F.linear`)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.is_contiguous() and x.stride(-1) == 1 and _onednn_enabled())


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x [N, K], weight [Nout, K], bias [Nout]? -> [N, Nout]."""
    if uses_onednn(x, weight) and (bias is None or bias.is_contiguous()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
