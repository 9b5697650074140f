"""The cpu vendor's W4A16 (`weight_quant_matmul`): C++ kernels of csrc/quant_w4.cpp.

Up to GEMV_MAX_ROWS rows (decode and prefill chunks alike): the weight is dequantised in
registers and streamed once per 8 rows (`w4_matmul`). More rows: the float32 weight is built a
block of 128-column tiles at a time (`w4_dequantise_tiles`, at most _BLOCK_BYTES) and multiplied
by BLAS, so the whole float weight never exists. The switch: measured on one core of the Zen 5
VM, the register kernel is 2-3x faster than the dequantise + BLAS path at every M from 1 to 512
(docs/benchmarks.md), so the switch sits at the kernel's own limit. Both read the canonical AWQ layout and the column_tiled one
(dlinfer/vendor/w4_layouts.py); `repack_weight_quant` is this vendor's load-time hook.

Importing this module builds the kernels if need be (`build.module()`).
"""

from typing import Optional

import torch
from torch import Tensor

from dlinfer.vendor import w4_layouts
from dlinfer.vendor.cpu import build

_kernels = build.module()
_w4_matmul = _kernels.w4_matmul
_dequantise_tiles = _kernels.w4_dequantise_tiles
_column_tiled = _kernels.w4_column_tiled
GEMV_MAX_ROWS = torch.ops.dlinfer_cpu.w4_max_rows()  # w4_matmul up to this M (the measured switch: see above)
_BLOCK_BYTES = 2 << 20  # float32 weight bytes per GEMM block of the prefill path
TILE_COLS = 128
_LANE_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]  # column 8j + r of a word sits in nibble lane r // 2 + 4 * (r % 2)


def _gemm(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
          group_size: int) -> Tensor:
    """x [M, K] @ W -> [M, N] float32, W dequantised to float32 a block of 128-column tiles at a
    time, in the kernel's lane order; the output columns are put back in order at the end (the
    canonical layout's; column_tiled lanes are in column order)."""
    m, k = x.shape
    n = scale.shape[1]
    tiles = -(-n // TILE_COLS)
    xf = x.float()
    lanes = torch.empty((m, tiles * TILE_COLS), dtype=torch.float32)
    step = max(1, _BLOCK_BYTES // (4 * k * TILE_COLS))
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        lanes[:, t0 * TILE_COLS:t1 * TILE_COLS] = xf @ _dequantise_tiles(qweight, scale, offset, group_size, t0, t1)
    if w4_layouts.is_column_tiled(qweight):  # lane (t, i, w) holds column 128t + 16i + w: in order
        out = lanes[:, :n]
    else:  # lane (t, i, w) holds column 8 * (16t + w) + ORDER[i]: to (t, w, column-in-word) order
        out = lanes.view(m, tiles, 8, 16).transpose(2, 3)[..., _LANE_OF_COLUMN].reshape(m, tiles * TILE_COLS)[:, :n]
    if bias is not None:
        out = out + bias.float()
    return out


def weight_quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
                        group_size: int) -> Tensor:
    """x [M, K], qweight int32 [K, N/8] or column_tiled [ceil(N/128), K, 16], scale [K/g, N] (x's
    dtype or float16), offset int32 [K/g, N/8]?, bias [N]?, group_size g -> [M, N] in x's dtype."""
    if x.shape[0] <= GEMV_MAX_ROWS:  # the kernels make qweight, scale and offset dense (C++, no copy if they are)
        return _w4_matmul(x, qweight, scale, offset, bias, group_size)
    return _gemm(x, qweight, scale, offset, bias, group_size).to(x.dtype)


def column_tiled(qweight: Tensor) -> Tensor:
    """canonical int32 [K, N/8] -> column_tiled int32 [ceil(N/128), K, 16] (C++, one pass)."""
    return _column_tiled(qweight)


def half_scales(scale: Tensor) -> Tensor:
    """float32 scales as float16 when every value is a float16 value (AWQ checkpoints store float16
    scales; the engine widens them to its dtype), else the tensor itself: the same numbers in half
    the bytes, which the kernels widen back exactly."""
    if scale.dtype != torch.float32:
        return scale
    half = scale.to(torch.float16)
    return half if torch.equal(half.to(torch.float32), scale) else scale


def repack_weight_quant(qweight: Tensor, scale: Tensor, offset: Optional[Tensor], group_size: int):
    """The vendor's load-time hook: qweight column_tiled, float32 scales as float16 where exact
    (`half_scales`), offset as it is. The register kernel reads a tile's words as one stream instead
    of K strided pieces: 1.2-3.6x faster at one row on SmolLM2-135M's shapes; float16 scales cut a
    decode step's W4 bytes by 6% at group 64, 11% at group 32 (docs/benchmarks.md). Outputs
    identical bit for bit."""
    return column_tiled(qweight.contiguous()), half_scales(scale.contiguous()), offset
