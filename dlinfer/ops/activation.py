"""SiLU-and-multiply (the SwiGLU gate)."""

from __future__ import annotations

import torch
from torch import Tensor

from dlinfer.ops import _checks as C
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, kernel_for


def silu_and_mul(input_tensor: Tensor, dim: int = -1) -> Tensor:
    """silu(x[..., :I]) * x[..., I:] along `dim`.

    input_tensor: [..., 2I] float32/float16/bfloat16 (2I along `dim`), not modified.
    Returns a new tensor [..., I] in the input dtype.
    """
    kernel = (_check_silu_and_mul(input_tensor, dim) if not torch.compiler.is_compiling()
              else checked("silu_and_mul", _check_silu_and_mul, input_tensor, dim))
    ndim = input_tensor.dim()
    dim = dim % ndim
    if ndim == 2 and dim == 1:
        return kernel(input_tensor)
    x = input_tensor if dim == ndim - 1 else input_tensor.movedim(dim, -1)
    lead = x.shape[:-1]
    out = kernel(x.reshape(-1, x.shape[-1]))
    out = out.view(*lead, x.shape[-1] // 2)
    return out if dim == ndim - 1 else out.movedim(-1, dim)


def _check_silu_and_mul(input_tensor, dim):
    """Checks silu_and_mul's arguments; returns the vendor's function (`kernel_for`)."""
    op = "silu_and_mul"
    ndim = C.rank_at_least(op, "input_tensor", input_tensor, 1, "[..., 2I]")
    C.dtype_in(op, "input_tensor", input_tensor, C.FLOAT_DTYPES)
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise C.InvalidArgumentError(op, "dim", f"an int in [{-ndim}, {ndim})", C.describe(dim))
    if input_tensor.shape[dim % ndim] % 2:
        raise C.InvalidArgumentError(op, "input_tensor", f"an even size in dim {dim % ndim}",
                                     C.describe(input_tensor))
    kernel, vendor = kernel_for(op, input_tensor.device)
    check_dtype(vendor, op, input_tensor.dtype)
    return kernel
