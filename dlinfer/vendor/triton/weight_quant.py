"""W4A16 (`weight_quant_matmul`) in Triton: the 4-bit weight unpacked in the kernel.

One program computes a [BLOCK_M, BLOCK_N] tile of y = x @ W, walking K in BLOCK_K steps, and
forms the integer weights q - z in [-15, 15] (exact in fp16 and bf16) in registers. Canonical
AWQ words are loaded once per 8 columns ([BLOCK_K, BLOCK_N / 8]) and unpacked with tl.join;
column_tiled ones are gathered per column by address and shift arithmetic (never a copy). When
BLOCK_K divides the group size (every real group size: 32, 64, 128, K), a K step lies inside one
group, so the step's product runs on the tensor cores in x's own dtype, x @ (q - z) with fp32
accumulation (exact products), and is scaled once per column by the group's scale:
acc += (x @ (q - z)) * s (docs/design.md, "W4A16 on a GPU"). The dequantised weight is never
rounded: rounding it to bf16 first (as a half-precision GEMM on dequantised weights does) fails
the conformance suite's extreme-value case (one element of 1848 off by 0.018). float32 x (and
bf16 under the interpreter, whose bf16 arithmetic is meaningless) takes the same path in IEEE fp32
(no TF32). A group size with no power-of-two divisor of at least 16 (tl.dot's smallest K) falls
back to a kernel that dequantises each element as float(q - z) * s in fp32 before an IEEE fp32
dot (small tiles: a slow path for odd group sizes only). Bias in fp32, one rounding to x's dtype.
Column c of word j = c // 8 sits at bits 4i..4i+3 with i = (c % 8) // 2 + 4 * (c % 2), the
inverse of AWQ's order [0, 2, 4, 6, 1, 3, 5, 7] (the zero points always; the weight in the
canonical layout; column_tiled: bits 4 * ((c % 128) // 16) of word c % 16 of tile c // 128).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor import w4_layouts
from dlinfer.vendor.triton._common import cast_to, num_sms, unit_stride
from dlinfer.vendor.triton.attention_common import dots_in_fp32


@triton.jit
def _tiled_codes(q_ptr, z_ptr, rk, rn, n_ok, g, K, N, HAS_ZEROS: tl.constexpr):
    """column_tiled [ceil(N/128), K, 16] words (column c at word c % 16 of tile c // 128, bits
    4 * ((c % 128) // 16)): the integer weights q - z of rows rk (one group, g) and columns rn,
    gathered per column: int32 [BLOCK_K, BLOCK_N]."""
    q_off = (rn // 128)[None, :] * (K * 16) + rk[:, None] * 16 + (rn % 16)[None, :]
    qw = tl.load(q_ptr + q_off, mask=n_ok[None, :], other=0)
    q = (qw >> (4 * ((rn % 128) // 16))[None, :]) & 15
    w = q - 8
    if HAS_ZEROS:  # the zero points keep the canonical packing
        r = rn % 8
        zw = tl.load(z_ptr + g * (N // 8) + rn // 8, mask=n_ok, other=0)
        w = q - ((zw >> (4 * ((r // 2) + 4 * (r % 2)))) & 15)[None, :]
    return w


@triton.jit
def _canonical_codes(q_ptr, z_ptr, rk, rq, q_ok, g, words, HAS_ZEROS: tl.constexpr):
    """Canonical [K, N/8] words: the integer weights q - z of rows rk (one group, g) and the 8
    columns of each word rq, each word loaded once: int32 [BLOCK_K, 8 * len(rq)]."""
    q = _unpack_words(tl.load(q_ptr + rk[:, None] * words + rq[None, :], mask=q_ok[None, :], other=0))
    w = q - 8
    if HAS_ZEROS:
        w = q - _unpack_words(tl.load(z_ptr + g * words + rq, mask=q_ok, other=0)[None, :])
    return w


@triton.jit
def _unpack_words(words):
    """int32 [R, Q] AWQ words -> int32 [R, 8Q] nibbles in column order: column 8j + c of word j sits
    at nibble i = c // 2 + 4 * (c % 2). Each tl.join appends an axis after the earlier ones, so
    the column index in a word is c = 4a + 2b + d for the joins' axes a (first), b, d (last), and
    nibble i = 2a + b + 4d picks what each join pairs."""
    n0 = words & 15
    n1 = (words >> 4) & 15
    n2 = (words >> 8) & 15
    n3 = (words >> 12) & 15
    n4 = (words >> 16) & 15
    n5 = (words >> 20) & 15
    n6 = (words >> 24) & 15
    n7 = (words >> 28) & 15
    low = tl.join(tl.join(n0, n2), tl.join(n1, n3))  # d = 0
    high = tl.join(tl.join(n4, n6), tl.join(n5, n7))  # d = 1
    both = tl.join(low, high)  # [R, Q, 2, 2, 2]
    return both.reshape(words.shape[0], 8 * words.shape[1])


@triton.jit
def _w4_group_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, G, stride_xm, K_SPLIT,
                     HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, TILED: tl.constexpr, F32: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_K divides G (and so K): each K step is inside one group, its scale a [BLOCK_N] row.
    Canonical words are loaded once per 8 columns ([BLOCK_K, BLOCK_N / 8]) and unpacked in
    registers; column_tiled ones are gathered per column. Program (m, n, s) walks K from
    s * K_SPLIT (a multiple of BLOCK_K) for K_SPLIT; with SPLIT it stores its fp32 sum at
    y_ptr[s, m, n] for _split_sum_kernel (no bias), else the output."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rq = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # the tile's words (N is a multiple of 8)
    m_ok = rm < M
    n_ok = rn < N
    words = N // 8
    q_ok = rq < words
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        g = k0 // G
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        if TILED:
            w = _tiled_codes(q_ptr, z_ptr, rk, rn, n_ok, g, K, N, HAS_ZEROS)
        else:
            w = _canonical_codes(q_ptr, z_ptr, rk, rq, q_ok, g, words, HAS_ZEROS)
        s = tl.load(s_ptr + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        if F32:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:  # integers up to 15 in magnitude: exact in x's dtype; products exact, fp32 sums
            part = tl.dot(x, w.to(x.dtype))
        acc += part * s[None, :]
    if SPLIT:
        out = y_ptr + pid_k.to(tl.int64) * M * N
        tl.store(out + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], cast_to(acc, y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_sum_kernel(p_ptr, b_ptr, y_ptr, MN, N, S, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over s = 0..S-1 of p[s] (in that order, fp32) (+ bias), one rounding: p [S, M, N]
    fp32 -> y [M, N]."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = p_ptr + i  # 64-bit addresses: each range's partials MN further on
    for s in range(0, S):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += MN
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, cast_to(acc, y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _w4_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, G, stride_xm,
               HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, TILED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    words = N // 8
    j = rn // 8  # the column's word
    r = rn % 8
    shift = 4 * ((r // 2) + 4 * (r % 2))  # its nibble
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        if TILED:  # [ceil(N/128), K, 16]: column c at word c % 16 of tile c // 128, bits 4 * ((c % 128) // 16)
            q_off = (rn // 128)[None, :] * (K * 16) + rk[:, None] * 16 + (rn % 16)[None, :]
            q_shift = 4 * ((rn % 128) // 16)
        else:  # [K, N/8]
            q_off = rk[:, None] * words + j[None, :]
            q_shift = shift
        wk_ok = k_ok[:, None] & n_ok[None, :]
        qw = tl.load(q_ptr + q_off, mask=wk_ok, other=0)
        q = (qw >> q_shift[None, :]) & 15
        gi = rk // G
        s = tl.load(s_ptr + gi[:, None] * N + rn[None, :], mask=wk_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zw = tl.load(z_ptr + gi[:, None] * words + j[None, :], mask=wk_ok, other=0)
            z = (zw >> shift[None, :]) & 15
        else:
            z = 8
        w = (q - z).to(tl.float32) * s
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], cast_to(acc, y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def weight_quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
                        group_size: int, *, num_splits: Optional[int] = None) -> Tensor:
    """x [M, K], qweight int32 [K, N/8] or column_tiled [ceil(N/128), K, 16] (k_interleaved: made
    canonical first), scale [K/g, N] (x's dtype or float16), offset int32 [K/g, N/8]?, bias [N]?,
    group_size g -> [M, N] in x's dtype. `num_splits` overrides the K-split rule (tests; the
    odd-group fallback kernel never splits)."""
    m, k = x.shape
    n = scale.shape[1]
    x = unit_stride(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if w4_layouts.is_k_interleaved(qweight):  # another vendor's load-time layout: read as canonical
        qweight = w4_layouts.canonical(qweight, n)
    qweight, scale = qweight.contiguous(), scale.contiguous()
    offset = None if offset is None else offset.contiguous()
    tiled = w4_layouts.is_column_tiled(qweight)
    common = (x, qweight, scale, offset if offset is not None else qweight, bias if bias is not None else scale,
              y, m, n, k, group_size, x.stride(0))
    flags = dict(HAS_ZEROS=offset is not None, HAS_BIAS=bias is not None, TILED=tiled)
    f32 = dots_in_fp32(x.dtype)
    block_m, block_n, most_k, warps, stages = _group_tiles(m, f32)
    block_k = _group_step(group_size, most_k)
    if block_k:
        m_tiles, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
        if num_splits is None:
            num_splits = _group_splits(m, k, block_k, m_tiles * n_tiles, num_sms(x.device))
        steps = k // block_k
        per_split = triton.cdiv(steps, max(1, min(num_splits, steps))) if steps else 0
        splits = triton.cdiv(steps, per_split) if steps else 1  # none left empty; K = 0: one empty range
        split = splits > 1
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if split else y
        common = (*common[:5], out, *common[6:])
        _w4_group_kernel[(m_tiles, n_tiles, splits)](
            *common, per_split * block_k, **flags, F32=f32, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages)
        if split:
            block = 1024
            _split_sum_kernel[(triton.cdiv(m * n, block),)](out, common[4], y, m * n, n, splits,
                                                            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
        return y
    block_m, block_n, block_k = 16, 32, 16  # no register spills on sm_80 / sm_90
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4_kernel[grid](*common, **flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def _group_step(group_size: int, most: int) -> int:
    """The largest power of two in [16, most] dividing the group size (one K step inside one
    group), or 0 when there is none."""
    step = most
    while step >= 16:
        if group_size % step == 0:
            return step
        step //= 2
    return 0


def _group_splits(m: int, k: int, block_k: int, programs: int, num_sms: int) -> int:
    """How many K ranges the group kernel's programs split K into. Few rows give few programs
    (M = 1, N = 11008: 172 on an H200's 132 SMs), each walking all of K: the weight streams at a
    fraction of HBM's rate. Split until about 4 programs an SM, ranges of at least 4 K steps (the
    last one may be shorter), and only while the fp32 partials written and read back (2 * 4 bytes * splits * M * N) stay
    within a quarter of the weight's K * N / 2 bytes (splits * M <= K / 64). The partials are
    summed in a fixed order (_split_sum_kernel): deterministic, a different fp32 order than one
    range. A CPU device counts as one SM."""
    want = triton.cdiv(4 * num_sms, max(1, programs))
    by_steps = max(1, (k // block_k) // 4)
    by_bytes = max(1, k // (64 * max(1, m)))
    return max(1, min(want, by_steps, by_bytes))


def _group_tiles(m: int, f32: bool):
    """(BLOCK_M, BLOCK_N, largest BLOCK_K, num_warps, num_stages) for M rows of x: BLOCK_M the power
    of two at or above M within [16, 128], 64 columns (32 in fp32), 128-row K steps for decode-sized
    M (the weight streams; few rows keep registers free), 64 above (32 in fp32). Larger tiles
    spill registers on sm_80 / sm_90 (the fp32 product of a K step is live beside the
    accumulator); scripts/triton_targets.py checks that none of these spills and that each fits
    sm_80's shared memory."""
    block_m = max(16, min(128, triton.next_power_of_2(max(1, m))))
    warps = 8 if block_m == 128 else 4
    if f32:
        return block_m, 32, 32, warps, 2
    return block_m, 64, 128 if block_m == 16 else 64, warps, 3
