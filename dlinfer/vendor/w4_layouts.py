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
k_interleaved: for integer dot products over k (the cpu vendor's integer kernel, csrc/quant_w4_int.cpp),
    with each group's scales and zero points inside the stream: `uint8 [ceil(N/64), K/g, B]`,
    K % 8 == 0, g % 8 == 0. A tile of KI_TILE_COLS = 64 columns is contiguous over K, one block of
    B bytes per group of g rows:
    - the 64 columns' scales of the group (zero past N): float16 where every scale of the weight is
      a float16 value (B = 192 + 32 g), else float32 (B = 320 + 32 g); B alone tells which, and g;
    - their 64 zero points, one byte each (8 without offsets, 0 past N);
    - g/8 x 4 lines of 64 bytes: line (b, v) of the group holds its rows 8b..8b+7 of columns
      64t + 16v + l (l = 0..15); its byte 4l + r holds row 8b + r in the low nibble and row
      8b + 4 + r in the high one. So a line's low nibbles are, per 32-bit lane, the 4 consecutive
      rows of one column that a 4-byte dot product (vpdpbusd) takes, and its high nibbles the next 4.
    Columns past N are zero. uint8 and rank 3 tell it from the others. A kernel reading it walks
    one stream per tile: the canonical scales and zero points are rows N columns apart per group,
    and their 2 x G extra streams per tile cost the integer kernel about a tenth of a decode step's time
    from memory at the 1B shape (measured,
    docs/notes/w4a16-kernels.md). The loader's scales and offsets stay as they are (every vendor
    still receives them; the cpu kernel reads the copies in the blocks).
`repack_weight_quant` (dlinfer.ops) asks the active vendor for its layout once, at load time;
every vendor function of the op receives any of them (a vendor that wants the canonical one
calls `canonical(qweight, n)`).
"""

from __future__ import annotations

from typing import Optional

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
KI_ZERO_BYTES = KI_TILE_COLS  # a group's zero points in a block: one byte per column


def ki_param_bytes(scale_bytes: int) -> int:
    """Bytes before a k_interleaved group's lines: its 64 scales (2 or 4 bytes each), 64 zero points."""
    return KI_TILE_COLS * scale_bytes + KI_ZERO_BYTES


def ki_block_bytes(group_size: int, scale_bytes: int) -> int:
    """Bytes of one group of one k_interleaved tile: parameters, then g/8 x 4 lines."""
    return ki_param_bytes(scale_bytes) + group_size // KI_BLOCK_K * KI_VECTORS * KI_LINE_BYTES


def ki_block_format(block_bytes: int):
    """(g, scale bytes) of a k_interleaved block of this many bytes, or None when no group fits it
    (g a positive multiple of 8; the two scale widths leave different remainders mod 256)."""
    line_bytes = KI_VECTORS * KI_LINE_BYTES
    for scale_bytes in (2, 4):
        rest = block_bytes - ki_param_bytes(scale_bytes)
        if rest > 0 and rest % line_bytes == 0:
            return rest // line_bytes * KI_BLOCK_K, scale_bytes
    return None


def num_tiles(n: int) -> int:
    """Tiles of the column_tiled layout for N output columns."""
    return (n + TILE_COLS - 1) // TILE_COLS


def is_column_tiled(qweight: Tensor) -> bool:
    """Whether a packed weight is in the column_tiled layout (int32, rank 3)."""
    return qweight.dim() == 3 and qweight.dtype == torch.int32


def is_k_interleaved(qweight: Tensor) -> bool:
    """Whether a packed weight is in the k_interleaved layout (uint8, rank 3)."""
    return qweight.dim() == 3 and qweight.dtype == torch.uint8


def is_repacked(qweight: Tensor) -> bool:
    """Whether a packed weight is in one of the vendors' load-time layouts rather than canonical."""
    return is_column_tiled(qweight) or is_k_interleaved(qweight)


def ki_num_tiles(n: int) -> int:
    """Tiles of the k_interleaved layout for N output columns."""
    return (n + KI_TILE_COLS - 1) // KI_TILE_COLS


def ki_scale_dtype(scale: Tensor) -> torch.dtype:
    """The dtype a k_interleaved block holds these scales in: float16 when each is a float16 value
    (an AWQ checkpoint's, or what the cpu vendor's hook narrowed), else float32 (exact for any)."""
    if scale.dtype == torch.float16:
        return torch.float16
    half = scale.to(torch.float16)
    return torch.float16 if torch.equal(half.to(scale.dtype), scale) else torch.float32


def k_interleaved(qweight: Tensor, scale: Tensor, offset: Optional[Tensor], group_size: int) -> Tensor:
    """canonical int32 [K, N/8], scale [K/g, N], offset int32 [K/g, N/8] or None, g (0: K; g % 8 ==
    0, K % 8 == 0) -> k_interleaved uint8 [ceil(N/64), K/g, B] (a new tensor)."""
    k, words = qweight.shape
    g = group_size or k
    if k % KI_BLOCK_K or g % KI_BLOCK_K or k % g:
        raise ValueError(f"k_interleaved needs K % {KI_BLOCK_K} == 0 and a group g with g % {KI_BLOCK_K} == 0 "
                         f"dividing K, got K = {k}, g = {g}")
    n, groups = words * WORD_COLS, k // g
    if tuple(scale.shape) != (groups, n) or (offset is not None and tuple(offset.shape) != (groups, words)):
        raise ValueError(f"k_interleaved: scale [{groups}, {n}] and offset [{groups}, {words}] or None, got "
                         f"{list(scale.shape)} and {None if offset is None else list(offset.shape)}")
    tiles = ki_num_tiles(n)
    width = tiles * KI_TILE_COLS
    values = torch.zeros(k, width, dtype=torch.int32, device=qweight.device)
    values[:, :n] = unpack(qweight)
    v = values.view(k // KI_BLOCK_K, 2, 4, tiles, KI_VECTORS, 16)  # [b, half, r, t, v, l]: row 8b + 4 half + r
    byte = v[:, 0] | (v[:, 1] << 4)  # [b, r, t, v, l]
    lines = byte.permute(2, 0, 3, 4, 1).reshape(tiles, groups, -1).to(torch.uint8)
    s = torch.zeros(groups, width, dtype=ki_scale_dtype(scale), device=qweight.device)
    s[:, :n] = scale
    s_bytes = s.view(groups, tiles, KI_TILE_COLS).transpose(0, 1).contiguous().view(torch.uint8)
    z = torch.zeros(groups, width, dtype=torch.int32, device=qweight.device)
    z[:, :n] = unpack(offset) if offset is not None else 8
    z_bytes = z.view(groups, tiles, KI_TILE_COLS).transpose(0, 1).to(torch.uint8)
    return torch.cat((s_bytes, z_bytes, lines), dim=2)


def ki_params(qweight: Tensor, n: int):
    """The scales (float16 or float32, as the blocks hold them) and zero points (int32) `[K/g, N]` a
    k_interleaved weight carries, n: the output columns N."""
    tiles, groups, block = qweight.shape
    _, scale_bytes = ki_block_format(block)
    dtype = torch.float16 if scale_bytes == 2 else torch.float32
    at = KI_TILE_COLS * scale_bytes
    scales = qweight[:, :, :at].contiguous().view(dtype)  # [tiles, G, 64]
    zeros = qweight[:, :, at:at + KI_ZERO_BYTES].to(torch.int32)
    return (scales.transpose(0, 1).reshape(groups, tiles * KI_TILE_COLS)[:, :n],
            zeros.transpose(0, 1).reshape(groups, tiles * KI_TILE_COLS)[:, :n])


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
        tiles, groups, block = qweight.shape
        g, scale_bytes = ki_block_format(block)
        blocks = groups * g // KI_BLOCK_K
        lines = qweight[:, :, ki_param_bytes(scale_bytes):]
        byte = lines.to(torch.int32).reshape(tiles, blocks, KI_VECTORS, 16, 4)  # [t, b, v, l, r]
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
