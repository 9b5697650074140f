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

`repack_weight_quant` (dlinfer.ops) asks the active vendor for its layout once, at load time;
every vendor function of the op receives either layout (a vendor that wants the canonical one
calls `canonical(qweight, n)`).
"""

from __future__ import annotations

import torch
from torch import Tensor

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8*j + ORDER[i]
WORD_COLS = 8  # output columns per int32 word
TILE_COLS = 128  # output columns per tile of the column_tiled layout
TILE_WORDS = TILE_COLS // WORD_COLS


def num_tiles(n: int) -> int:
    """Tiles of the column_tiled layout for N output columns."""
    return (n + TILE_COLS - 1) // TILE_COLS


def is_column_tiled(qweight: Tensor) -> bool:
    """Whether a packed weight is in the column_tiled layout (rank 3) rather than canonical (rank 2)."""
    return qweight.dim() == 3


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
    """Either layout -> canonical int32 [K, N/8] (the tensor itself when already canonical, else a
    copy); n: the output columns N (the scales' last dim)."""
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
