"""W4A16: a linear layer whose weight is 4-bit, in LMDeploy's AWQ "gemm" layout, as LMDeploy 0.18
calls it (`kernels/dlinfer/awq_kernels.py`: `weight_quant_matmul(x.squeeze(0), qweight, scales,
offset=qzeros, bias=bias, all_reduce=all_reduce, group_size=group_size)`).

`W[k, c] = (q[k, c] - z[k // g, c]) * s[k // g, c]`, q and z unsigned 4-bit; the packing is
dlinfer/vendor/w4_layouts.py's (canonical, or a layout the vendor's `repack_weight_quant` returns
once at load time: column_tiled, k_interleaved).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from dlinfer.ops import _checks as C
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, int_arg, kernel_for
from dlinfer.ops.linear import sum_over_group
from dlinfer.vendor import w4_layouts as L
from dlinfer.vendor.selection import resolve

I32 = (torch.int32,)
_REPACKED = "column_tiled int32 [ceil(N/128), K, 16], or k_interleaved uint8 [ceil(N/64), K/g, B]"


def _check_weights(op: str, qweight, scale, offset, group_size, k: Optional[int], dtype, device):
    """Checks qweight / scale / offset / group_size against each other (and x's K, dtype and device
    when given); returns (N, g), g the resolved group size."""
    C.tensor(op, "scale", scale, ("K/g", "N"), C.FLOAT_DTYPES, device)
    n = scale.shape[1]
    if n % 8:
        raise C.InvalidArgumentError(op, "scale", "N (dim 1 of [K/g, N]) a multiple of 8", C.describe(scale))
    if not isinstance(qweight, Tensor) or qweight.dim() not in (2, 3):
        raise C.InvalidArgumentError(op, "qweight", f"a tensor int32 [K, N/8] (or {_REPACKED})", C.describe(qweight))
    if qweight.dim() == 3 and qweight.dtype != torch.uint8:
        C.tensor(op, "qweight", qweight, (L.num_tiles(n), "K", L.TILE_WORDS), I32, device)
        k_w = qweight.shape[1]
    elif qweight.dim() == 3:
        C.tensor(op, "qweight", qweight, (L.ki_num_tiles(n), scale.shape[0], "B"), (torch.uint8,), device)
        block = L.ki_block_format(qweight.shape[2])
        if block is None:
            raise C.InvalidArgumentError(op, "qweight", "k_interleaved blocks of B = 192 + 32 g or 320 + 32 g bytes "
                                         "(g % 8 == 0)", C.describe(qweight))
        k_w = qweight.shape[1] * block[0]
    else:
        C.tensor(op, "qweight", qweight, ("K", n // 8), I32, device)
        k_w = qweight.shape[0]
    if k is not None and k_w != k:
        raise C.InvalidArgumentError(op, "qweight", f"K == {k} (x's last dim) rows", C.describe(qweight))
    if k_w < 1:
        raise C.InvalidArgumentError(op, "qweight", "K >= 1 rows", C.describe(qweight))
    g = C.integer(op, "group_size", group_size, 0) or k_w
    if k_w % g:
        raise C.InvalidArgumentError(op, "group_size", f"a divisor of K = {k_w} (or 0: one group)", str(group_size))
    C.tensor(op, "scale", scale, (k_w // g, n))
    if dtype is not None and scale.dtype not in (dtype, torch.float16):
        raise C.InvalidArgumentError(op, "scale", f"dtype {dtype} (same as x) or torch.float16", C.describe(scale))
    if offset is not None:
        C.tensor(op, "offset", offset, (k_w // g, n // 8), I32, device)
    if L.is_k_interleaved(qweight) and C.check_values_enabled():
        _check_carried_parameters(op, qweight, scale, offset, n)
    return n, g


def _check_carried_parameters(op, qweight, scale, offset, n):
    """Value check: a k_interleaved weight's own scales and zero points (which the cpu kernel reads)
    are the ones given (which every other reader of the weight uses)."""
    carried_scale, carried_zeros = L.ki_params(qweight, n)
    given = scale.float()
    same = (carried_scale.float() == given) | (carried_scale.isnan() & given.isnan())
    if not bool(same.all()):
        raise C.InvalidArgumentError(op, "scale", "the scales the k_interleaved qweight carries in its blocks",
                                     f"{int((~same).sum())} of {same.numel()} different")
    zeros = L.unpack(offset) if offset is not None else torch.full_like(carried_zeros, 8)
    if not torch.equal(carried_zeros, zeros):
        raise C.InvalidArgumentError(op, "offset", "the zero points the k_interleaved qweight carries in its blocks",
                                     f"{int((carried_zeros != zeros).sum())} of {zeros.numel()} different")


def weight_quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor] = None,
                        bias: Optional[Tensor] = None, all_reduce: bool = False, group_size: int = 0) -> Tensor:
    """x @ W (+ bias) with W 4-bit (AWQ gemm layout), then (when all_reduce) a sum over the default
    process group, as `dlinfer.ops.linear` does it.

    x: [..., K] float32/float16/bfloat16, not modified.
    qweight: int32 [K, N/8], output column 8*j + [0, 2, 4, 6, 1, 3, 5, 7][i] at bits 4i..4i+3 of
        qweight[:, j] (or what `repack_weight_quant` returned: column_tiled int32 [ceil(N/128), K, 16]
        or k_interleaved uint8 [ceil(N/64), K/g, B] with each group's scales and zero points in its
        block, dlinfer/vendor/w4_layouts.py).
    scale: [K/g, N] in x's dtype, or float16 (AWQ checkpoints' own dtype, widened exactly to float32
        in the kernel; what the cpu vendor's `repack_weight_quant` returns).
    offset: the zero points, int32 [K/g, N/8] packed like qweight, or None (zero point 8).
    bias: [N] in x's dtype, or None.  All on x's device.
    group_size: g, a divisor of K; 0 means one group of K rows.
    Returns a new tensor [..., N] in x's dtype (fp32 accumulation, one final rounding).
    """
    args = (x, qweight, scale, offset, bias, all_reduce, group_size)
    kernel = (_check_weight_quant_matmul(*args) if not torch.compiler.is_compiling()
              else checked("weight_quant_matmul", _check_weight_quant_matmul, *args))
    k = x.shape[-1]
    g = int_arg(group_size) or k
    if x.dim() == 2:
        out = kernel(x, qweight, scale, offset, bias, g)
    else:
        out = kernel(x.reshape(math.prod(x.shape[:-1]), k), qweight, scale, offset, bias, g)
        out = out.view(*x.shape[:-1], scale.shape[1])
    if all_reduce:
        sum_over_group(out)
    return out


def _check_weight_quant_matmul(x, qweight, scale, offset, bias, all_reduce, group_size):
    """Checks weight_quant_matmul's arguments; returns the vendor's function (`kernel_for`)."""
    op = "weight_quant_matmul"
    C.rank_at_least(op, "x", x, 1, "[..., K]")
    C.dtype_in(op, "x", x, C.FLOAT_DTYPES)
    device = x.device
    n, _ = _check_weights(op, qweight, scale, offset, group_size, x.shape[-1], x.dtype, device)
    if bias is not None:
        C.tensor(op, "bias", bias, (n,), C.FLOAT_DTYPES, device)
        C.same_dtype(op, "bias", bias, x, "x")
    if not isinstance(all_reduce, bool):
        raise C.InvalidArgumentError(op, "all_reduce", "a bool", C.describe(all_reduce))
    kernel, vendor = kernel_for(op, device)
    check_dtype(vendor, op, x.dtype)
    return kernel


def repack_weight_quant(qweight: Tensor, scale: Tensor, offset: Optional[Tensor] = None,
                        group_size: int = 0) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The W4A16 weights of one layer in the layout the active vendor's `weight_quant_matmul`
    reads fastest: call once at load time (the framework adaptor does), then pass the results to
    every `weight_quant_matmul` call in place of the loaded ones.

    qweight: int32 [K, N/8] (canonical AWQ gemm layout).  scale: [K/g, N] float.
    offset: int32 [K/g, N/8] or None.  group_size: g (0: one group of K).  All on one device.
    Returns (qweight', scale', offset'): the vendor's `repack_weight_quant` hook's result (the cpu
    vendor: qweight k_interleaved uint8 [ceil(N/64), K/g, B] on a CPU with AVX-512 VNNI and
    AMX-INT8, or VNNI and AVX512-BF16 for bfloat16 scales (a bfloat16 model), else column_tiled
    int32 [ceil(N/128), K, 16], and float32 scales as float16 when every one of them
    is a float16 value, so the same numbers in half the bytes), or the arguments
    themselves when the vendor has none or qweight is repacked already. A hook may change the
    scales' dtype only to float16, and only without changing a value (checked here).
    """
    op = "repack_weight_quant"
    device = qweight.device if isinstance(qweight, Tensor) else None
    _, g = _check_weights(op, qweight, scale, offset, group_size, None, None, device)
    if L.is_repacked(qweight):
        return qweight, scale, offset
    vendor = resolve("weight_quant_matmul", device.type)[1]
    if vendor.repack_weight_quant is None:
        return qweight, scale, offset
    packed = tuple(vendor.repack_weight_quant(qweight, scale, offset, g))
    result = f"{op} (vendor {vendor.name}'s result)"
    _check_weights(result, packed[0], packed[1], packed[2], group_size, qweight.shape[0], scale.dtype, device)
    if packed[1].dtype != scale.dtype and not torch.equal(packed[1].to(scale.dtype), scale):
        raise C.InvalidArgumentError(result, "scale", f"the same values as the given {scale.dtype} scales",
                                     "values changed by the conversion")
    return packed
