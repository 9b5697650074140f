"""The cpu vendor's W4A16 (`weight_quant_matmul`): C++ kernels of csrc/quant_w4.cpp.

Few rows (decode, M <= GEMV_MAX_ROWS): the weight is dequantised in registers and streamed once
per call (`w4_matmul_few_rows`). More rows (prefill): the float32 weight is built a block of
columns at a time (`w4_dequantise`, at most _BLOCK_BYTES) and multiplied by BLAS, so the whole
float weight never exists. Both read the canonical AWQ layout and the column_tiled one
(dlinfer/vendor/w4_layouts.py); `repack_weight_quant` is this vendor's load-time hook.

Importing this module needs the kernels loaded (`build.build()`).
"""

from typing import Optional

import torch
from torch import Tensor

_few_rows = torch.ops.dlinfer_cpu.w4_matmul_few_rows.default
_dequantise = torch.ops.dlinfer_cpu.w4_dequantise.default
_column_tiled = torch.ops.dlinfer_cpu.w4_column_tiled.default
MAX_FEW_ROWS = torch.ops.dlinfer_cpu.w4_max_few_rows()
GEMV_MAX_ROWS = MAX_FEW_ROWS  # few-rows kernel up to this M (docs/benchmarks.md: the measured switch)
_BLOCK_BYTES = 2 << 20  # float32 weight bytes per GEMM block of the prefill path


def _gemm(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
          group_size: int) -> Tensor:
    """x [M, K] @ W, W dequantised to float32 one block of columns at a time -> [M, N] float32."""
    k, n = x.shape[1], scale.shape[1]
    xf = x.float()
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    width = max(128, _BLOCK_BYTES // (4 * k) // 128 * 128)
    for c0 in range(0, n, width):
        c1 = min(n, c0 + width)
        out[:, c0:c1] = xf @ _dequantise(qweight, scale, offset, group_size, c0, c1)
    if bias is not None:
        out += bias.float()
    return out


def weight_quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
                        group_size: int) -> Tensor:
    """x [M, K], qweight int32 [K, N/8] or column_tiled [ceil(N/128), K, 16], scale [K/g, N] (x's
    dtype), offset int32 [K/g, N/8]?, bias [N]?, group_size g -> [M, N] in x's dtype."""
    scale = scale.contiguous()
    offset = None if offset is None else offset.contiguous()
    qweight = qweight.contiguous()
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _few_rows(x, qweight, scale, offset, bias, group_size)
    return _gemm(x, qweight, scale, offset, bias, group_size).to(x.dtype)


def column_tiled(qweight: Tensor) -> Tensor:
    """canonical int32 [K, N/8] -> column_tiled int32 [ceil(N/128), K, 16] (C++, one pass)."""
    return _column_tiled(qweight)
