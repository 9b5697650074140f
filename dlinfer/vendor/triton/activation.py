"""SiLU-and-mul: out[n, i] = silu(x[n, i]) * x[n, I + i].

Algorithm: program (row, column block); gate and up tiles loaded, fp32 math
(g * sigmoid(g) * u), one rounding to the activation dtype. BLOCK = next pow2 of I, at most 1024.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor.triton._common import cast_to, next_pow2, unit_stride


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_out + cols, cast_to(out, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor) -> Tensor:
    """x [N, 2I] -> [N, I]."""
    x = unit_stride(x)
    n, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n == 0 or inter == 0:
        return out
    block = min(next_pow2(inter), 1024)
    _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4 if block <= 512 else 8
    )
    return out
