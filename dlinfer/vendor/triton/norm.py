"""RMSNorm and fused residual-add + RMSNorm.

Algorithm: one program per row, the whole row in one block (BLOCK_H = next pow2 of H, masked).
  s   = h + r                     (add_rms_norm: rounded to the activation dtype, stored)
  y   = s * rsqrt(mean(s^2) + eps)  in fp32
  out = cast(cast(y, dtype) * w)    (HF Llama order: cast back before the weight multiply)
num_warps grows with the block (4 up to 2K elements, 8, 16, 32).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor.triton._common import cast_to, next_pow2, row_warps, unit_stride


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_out, stride_sum,
                     H, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # fp32 add then one rounding == the add in the activation dtype (fp32 has > 2p+2 bits).
        s = cast_to(x + r, dtype)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = cast_to(x * tl.rsqrt(var + eps), dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast_to(y * w, dtype), mask=mask)


def _launch(x: Tensor, residual, weight: Tensor, epsilon: float, out: Tensor, summed) -> None:
    n, h = x.shape
    if n == 0:
        return
    block = next_pow2(h)
    has_res = residual is not None
    _rms_norm_kernel[(n,)](
        x, residual if has_res else x, unit_stride(weight), out, summed if has_res else out,
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0), summed.stride(0) if has_res else 0,
        h, float(epsilon), HAS_RESIDUAL=has_res, BLOCK_H=block, num_warps=row_warps(block),
    )


def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """hidden_states [N, H], weight [H] -> [N, H] in hidden_states' dtype."""
    x = unit_stride(hidden_states)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, epsilon, out, None)
    return out


def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float):
    """([N, H], [N, H], [H]) -> (rms_norm(h + r), h + r), both written by one pass over each row."""
    x, r = unit_stride(hidden_states), unit_stride(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, r, weight, epsilon, out, summed)
    return out, summed
