"""The layouts of a W4A16 (`weight_quant_matmul`) packed weight: the only code that knows them.

canonical: LMDeploy's AWQ "gemm" layout, as its loader holds it: `qweight int32 [K, N/8]`; output
    column `c = 8*j + ORDER[i]` sits at bits `4i..4i+3` of `qweight[:, j]` (unsigned 0..15),
    `ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`. The zero points (`qzeros int32 [K/g, N/8]`) are packed
    alike.
column_tiled: the same nibbles, regrouped so that a tile of TILE_COLS = 128 output columns is
    contiguous over all K rows, in column order inside the tile: `int32 [ceil(N/128), K, 16]`,
    bits `4i..4i+3` of word `w` of tile `t` at row k holding column `128*t + 16*i + w` (row k's
    value); columns past N are zero. A kernel that walks K for a band of columns then reads one
    contiguous stream per tile instead of K strided 64-byte pieces, and nibble i of the tile's 16
    words is 16 consecutive columns, so their 16 scales are one contiguous load (canonical words
    interleave their columns, [0, 2, 4, 6, 1, 3, 5, 7], which costs a kernel gathers per group).
    Rank 3 tells it from the canonical rank-2 layout. Scales and zero points keep their canonical
    layouts.
k_interleaved: for integer dot products over k (the cpu vendor's integer kernel, csrc/quant_w4_int.cpp):
    `uint8 [ceil(N/64), K/8, 4, 64]`, K % 8 == 0. A tile of KI_TILE_COLS = 64 columns is
    contiguous over K, as 64-byte lines of 8 rows x 16 columns: line (t, b, v) holds rows
    8b..8b+7 of columns 64t + 16v + l (l = 0..15); its byte 4l + r holds row 8b + r in the low
    nibble and row 8b + 4 + r in the high one. So a line's low nibbles are, per 32-bit lane, the 4
    consecutive rows of one column that a 4-byte dot product (vpdpbusd) takes, and its high
    nibbles the next 4. Columns past N are zero. uint8 and rank 4 tell it from the others; scales
    and zero points keep their canonical layouts.

`repack_weight_quant` (dlinfer.ops) asks the active vendor for its layout once, at load time;
every vendor function of the op receives any of them (a vendor that wants the canonical one
calls `canonical(qweight, n)`).
"""

from __future__ import annotations

import torch
from torch import Tensor

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8*j + ORDER[i]
WORD_COLS = 8  # output columns per int32 word
TILE_COLS = 128  # output columns per tile of the column_tiled layout
TILE_WORDS = TILE_COLS // WORD_COLS
KI_TILE_COLS = 64  # output columns per tile of the k_interleaved layout
KI_BLOCK_K = 8  # rows of k per 64-byte line of the k_interleaved layout
KI_VECTORS = KI_TILE_COLS // 16  # 16-column lines per block of rows
KI_LINE_BYTES = 64


def num_tiles(n: int) -> int:
    """Tiles of the column_tiled layout for N output columns."""
    return (n + TILE_COLS - 1) // TILE_COLS


def is_column_tiled(qweight: Tensor) -> bool:
    """Whether a packed weight is in the column_tiled layout (int32, rank 3)."""
    return qweight.dim() == 3


def is_k_interleaved(qweight: Tensor) -> bool:
    """Whether a packed weight is in the k_interleaved layout (uint8, rank 4)."""
    return qweight.dim() == 4 and qweight.dtype == torch.uint8


def is_repacked(qweight: Tensor) -> bool:
    """Whether a packed weight is in one of the vendors' load-time layouts rather than canonical."""
    return is_column_tiled(qweight) or is_k_interleaved(qweight)


def ki_num_tiles(n: int) -> int:
    """Tiles of the k_interleaved layout for N output columns."""
    return (n + KI_TILE_COLS - 1) // KI_TILE_COLS


def k_interleaved(qweight: Tensor) -> Tensor:
    """canonical int32 [K, N/8] (K % 8 == 0) -> k_interleaved uint8 [ceil(N/64), K/8, 4, 64] (a new tensor)."""
    k, words = qweight.shape
    if k % KI_BLOCK_K:
        raise ValueError(f"k_interleaved needs K % {KI_BLOCK_K} == 0, got K = {k}")
    tiles = ki_num_tiles(words * WORD_COLS)
    values = torch.zeros(k, tiles * KI_TILE_COLS, dtype=torch.int32, device=qweight.device)
    values[:, : words * WORD_COLS] = unpack(qweight)
    v = values.view(k // KI_BLOCK_K, 2, 4, tiles, KI_VECTORS, 16)  # [b, half, r, t, v, l]: row 8b + 4 half + r
    byte = v[:, 0] | (v[:, 1] << 4)  # [b, r, t, v, l]
    return byte.permute(2, 0, 3, 4, 1).reshape(tiles, k // KI_BLOCK_K, KI_VECTORS, KI_LINE_BYTES).to(torch.uint8)


def column_tiled(qweight: Tensor) -> Tensor:
    """canonical int32 [K, N/8] -> column_tiled int32 [ceil(N/128), K, 16] (a new tensor)."""
    k, words = qweight.shape
    tiles = num_tiles(words * WORD_COLS)
    values = torch.zeros(k, tiles * TILE_COLS, dtype=torch.int64, device=qweight.device)
    values[:, : words * WORD_COLS] = unpack(qweight)
    nibbles = values.view(k, tiles, WORD_COLS, TILE_WORDS)  # [k, t, i, w]: column 128t + 16i + w
    packed = torch.zeros(k, tiles, TILE_WORDS, dtype=torch.int64, device=qweight.device)
    for i in range(WORD_COLS):
        packed |= nibbles[:, :, i, :] << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.permute(1, 0, 2).contiguous()


def canonical(qweight: Tensor, n: int) -> Tensor:
    """Any layout -> canonical int32 [K, N/8] (the tensor itself when already canonical, else a
    copy); n: the output columns N (the scales' last dim)."""
    if is_k_interleaved(qweight):
        tiles, blocks = qweight.shape[:2]
        byte = qweight.to(torch.int32).view(tiles, blocks, KI_VECTORS, 16, 4)  # [t, b, v, l, r]
        halves = torch.stack((byte & 15, byte >> 4), dim=1)  # [t, half, b, v, l, r]
        values = halves.permute(2, 1, 5, 0, 3, 4)  # [b, half, r, t, v, l]: row 8b + 4 half + r, column 64t + 16v + l
        return pack(values.reshape(blocks * KI_BLOCK_K, tiles * KI_TILE_COLS)[:, :n])
    if not is_column_tiled(qweight):
        return qweight
    tiles, k, _ = qweight.shape
    shifts = torch.arange(0, 4 * WORD_COLS, 4, dtype=torch.int32, device=qweight.device)
    nibbles = (qweight.permute(1, 0, 2).unsqueeze(2) >> shifts.view(1, 1, WORD_COLS, 1)) & 15  # [k, t, i, w]
    return pack(nibbles.reshape(k, tiles * TILE_COLS)[:, :n])


def pack(values: Tensor) -> Tensor:
    """The 4-bit values `[R, N]` (integers 0..15, N % 8 == 0) -> canonical-packed int32 `[R, N/8]`
    (the inverse of `unpack`; what a checkpoint writer stores as qweight / qzeros)."""
    r, n = values.shape
    v = values.to(torch.int64).reshape(r, n // WORD_COLS, WORD_COLS)
    packed = torch.zeros(r, n // WORD_COLS, dtype=torch.int64, device=values.device)
    for i, col in enumerate(ORDER):
        packed |= v[:, :, col] << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # the same 32 bits, as signed int32
    return packed.to(torch.int32)


def unpack(packed: Tensor) -> Tensor:
    """canonical-packed int32 [R, N/8] -> the 4-bit values int32 [R, N] in column order."""
    shifts = torch.tensor([4 * ORDER.index(c) for c in range(WORD_COLS)], dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & 15
    return values.reshape(packed.shape[0], packed.shape[1] * WORD_COLS)
