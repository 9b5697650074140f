"""Paged decode attention: split-KV flash-decoding.

Algorithm. Query token t of sequence b (n_b tokens; speculative decoding gives n_b > 1) sits at
position q_pos = kv_len[b] - n_b + i and sees cache positions 0..q_pos. Kernel 1 runs one program
per (token, kv head, KV segment): the G = Hq / Hkv query heads sharing the kv head are packed
into one [BLOCK_H, D] tile (BLOCK_H >= 16), so each K/V tile gathered from the paged cache is
read once for the whole group and both products are real tl.dot tiles. The program walks its
segment of keys with an online softmax (running max / sum in fp32) and writes its normalised
partial output and its log-sum-exp. Kernel 2 combines the segments of each (token, head):
out = sum_s exp2(lse_s - max) * o_s / sum_s exp2(lse_s - max). With one segment kernel 1 writes
the output directly and kernel 2 does not run.

A sliding window W: token t sees only positions q_pos - W + 1 .. q_pos, so the segments cut that
range (at most W keys, which the split rule is given as the longest), and no block before it is
read. A soft cap bends the scores first (attention_common.soft_cap).

Split rule (`num_kv_splits`): programs = tokens x kv heads x splits. Split only until there are
about 4 programs per SM (enough K/V loads in flight to saturate HBM), never into segments shorter
than 128 keys (below that the partial write + reduce costs more than the parallelism gains: on the
H200, batch 8 x 1k context, 8 segments of 128 keys beat 4 of 256 and 16 of 64, docs/gpu.md), and
never into more than 64. No autotuning; a CPU device counts as one SM.

No host syncs: the sequence of each token is found inside the kernel (a guess that is exact for
equal token counts, else a binary search over cu_seqlens_q), and the grid is sized by T and max_kv_seq_len
(upper bounds). The last segment runs to
the token's own context length, so a too-small max_kv_seq_len never drops keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlinfer.vendor.kv_layouts import canonical
from dlinfer.vendor.triton._common import cast_to, num_sms
from dlinfer.vendor.triton.attention_common import (
    block_dim,
    dots_in_fp32,
    online_softmax_step,
    paged_slots,
    score_scale,
    soft_cap,
)

MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4


def num_kv_splits(num_tokens: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
                  programs_per_sm: int = PROGRAMS_PER_SM, min_keys: int = MIN_KEYS_PER_SPLIT) -> int:
    """How many KV segments each (token, kv head) is split into; see the module docstring."""
    want = triton.cdiv(programs_per_sm * num_sms, max(1, num_tokens * num_kv_heads))
    cap = max(1, triton.cdiv(max_kv_len, min_keys))
    return max(1, min(want, cap, MAX_SPLITS))


def split_plan(max_kv_len: int, num_splits: int, d_tile: int, fp32: bool = False, tile_keys: int = 0):
    """(splits, keys per segment, keys per tile). Keys per tile: `tile_keys` if given, else 64 (32
    for head dims up to 256, 16 above: MLA's 576 / 512; half that for fp32), at least 16 for tl.dot,
    never much above a segment: every launch fits sm_80's shared memory
    (scripts/triton_targets.py). Segments are whole tiles; splits that the rounding left empty are
    dropped."""
    max_kv = max(1, max_kv_len)
    seg_len = triton.cdiv(max_kv, max(1, num_splits))
    cap = tile_keys or max(16, (64 if d_tile <= 128 else 32 if d_tile <= 256 else 16) // (2 if fp32 else 1))
    block_n = min(cap, max(16, triton.next_power_of_2(seg_len)))
    seg_len = triton.cdiv(seg_len, block_n) * block_n
    return triton.cdiv(max_kv, seg_len), seg_len, block_n


def _tiles(d_tile: int, fp32: bool):
    """(programs per SM and fewest keys a segment for the split rule, keys per tile (0:
    split_plan's rule), num_warps, num_stages (0: Triton's default)) of the split kernel.
    benchmarks/gpu_tile_sweep.py replaces this function to time alternatives on a GPU."""
    return PROGRAMS_PER_SM, MIN_KEYS_PER_SPLIT, 0, 8 if fp32 or d_tile > 128 else 4, 0


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, kvlen_ptr, alibi_ptr, out_ptr, opart_ptr, lse_ptr, kvq_ptr,
    B, M, NB, BS, seg_len, qk_scale, window, softcap,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_btb, s_btm,
    s_ot, s_oh, s_od,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_ALIBI: tl.constexpr, F32: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n_splits = tl.num_programs(2)
    hq = tl.num_programs(1) * G

    # Sequence of token t: the b < B with cu[b] <= t < cu[b+1]. First guess t * B // T (exact
    # when every sequence has the same token count, e.g. plain decode); else a binary search for
    # the largest b with cu[b] <= t (empty sequences are skipped over).
    guess = tl.minimum((t.to(tl.int64) * B // tl.num_programs(0)).to(tl.int32), B - 1)
    hit = (tl.load(cu_ptr + guess) <= t) & (tl.load(cu_ptr + guess + 1) > t)
    lo = tl.where(hit, guess, 0)
    hi = tl.where(hit, guess + 1, B)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) <= t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    q_start = tl.load(cu_ptr + lo)
    q_end = tl.load(cu_ptr + lo + 1)
    q_pos = tl.load(kvlen_ptr + lo) - (q_end - q_start) + (t - q_start)
    ctx = tl.minimum(q_pos + 1, M * BS)  # keys 0..ctx-1; never past the block table
    first = 0
    if WINDOW:  # keys first..ctx-1
        first = tl.maximum(q_pos - window + 1, 0)
    seg_start = first + s * seg_len
    seg_end = tl.where(s == n_splits - 1, ctx, tl.minimum(seg_start + seg_len, ctx))

    rows = tl.arange(0, BLOCK_H)
    heads = kvh * G + rows
    row_ok = rows < G
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    t64 = t.to(tl.int64)
    q = tl.load(q_ptr + t64 * s_qt + heads[:, None] * s_qh + dk[None, :] * s_qd,
                mask=row_ok[:, None] & (dk < D)[None, :], other=0.0)
    if F32:
        q = q.to(tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634

    if QUANT:  # int8 caches: per-kv-head scale / zero ([4, Hkv] float32: k_scale, k_zero, v_scale, v_zero)
        n_kvh = tl.num_programs(1)
        k_sc = tl.load(kvq_ptr + kvh)
        k_zp = tl.load(kvq_ptr + n_kvh + kvh)
        v_sc = tl.load(kvq_ptr + 2 * n_kvh + kvh)
        v_zp = tl.load(kvq_ptr + 3 * n_kvh + kvh)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    bt_row = bt_ptr + lo.to(tl.int64) * s_btb
    for start in range(seg_start, seg_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < seg_end
        blk, slot = paged_slots(bt_row, s_btm, pos, valid, BS, M, NB)
        k = tl.load(k_ptr + (blk * s_kb + slot * s_ks + kvh * s_kh)[:, None] + dk[None, :] * s_kd,
                    mask=valid[:, None] & (dk < D)[None, :], other=0.0)
        v = tl.load(v_ptr + (blk * s_vb + slot * s_vs + kvh * s_vh)[:, None] + dv[None, :] * s_vd,
                    mask=valid[:, None] & (dv < DV)[None, :], other=0.0)
        if QUANT:  # dequantised in registers (F32 is set with QUANT)
            k = (k.to(tl.float32) - k_zp) * k_sc
            v = (v.to(tl.float32) - v_zp) * v_sc
        elif F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if SOFTCAP:
            qk = soft_cap(qk, softcap)
        if HAS_ALIBI:
            qk += slope[:, None] * (pos - q_pos).to(tl.float32)[None, :]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, F32)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key at all: 0, not NaN
    if SPLIT:
        part = (t64 * hq + heads) * n_splits + s
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
        tl.store(opart_ptr + part[:, None] * DV + dv[None, :], o, mask=row_ok[:, None] & (dv < DV)[None, :])
    else:
        tl.store(out_ptr + t64 * s_ot + heads[:, None] * s_oh + dv[None, :] * s_od,
                 cast_to(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])


@triton.jit
def _decode_reduce_kernel(
    opart_ptr, lse_ptr, out_ptr, S,
    s_ot, s_oh, s_od,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = t * tl.num_programs(1) + h
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(lse_ptr + row * S + sp, mask=sp < S, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty segments weigh 0
    o = tl.load(opart_ptr + (row * S + sp)[:, None] * DV + dv[None, :],
                mask=(sp < S)[:, None] & (dv < DV)[None, :], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + t * s_ot + h * s_oh + dv * s_od, cast_to(res, out_ptr.dtype.element_ty), mask=dv < DV)


def paged_decode(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len,
                 softmax_scale, alibi_slopes, out, kv_layout, quant=(None, None, None, None),
                 num_splits=None, window=0, softcap=0.0) -> None:
    """Launcher. query [T, Hq, D] -> out [T, Hq, Dv] (may be strided). quant: (k_scale, k_zero,
    v_scale, v_zero) [Hkv] float32 for int8 caches (dequantised in registers, dots in fp32), or
    Nones. `num_splits` overrides the split rule (tests). window, softcap: 0 for none."""
    t, hq, d = query.shape
    dv = value_cache.shape[-1]
    b = cu_seqlens_q.shape[0] - 1
    if t == 0:
        return
    if b <= 0:  # tokens but no sequence: nothing to attend to
        out.zero_()
        return
    key_cache, value_cache = canonical(key_cache, kv_layout), canonical(value_cache, kv_layout)  # [NB, BS, Hkv, D]
    nb, bs, hkv = key_cache.shape[:3]
    g = hq // hkv
    m = block_table.shape[1]
    block_d, block_dv = block_dim(d), block_dim(dv)
    span = min(max_kv_seq_len, window) if window > 0 else max_kv_seq_len  # the most keys a token sees
    is_quant = quant[0] is not None
    fp32 = query.dtype == torch.float32
    per_sm, min_keys, tile_keys, warps, stages = _tiles(max(block_d, block_dv), fp32)
    if num_splits is None:
        num_splits = num_kv_splits(t, hkv, span, num_sms(query.device), per_sm, min_keys)
    num_splits, seg_len, block_n = split_plan(span, num_splits, max(block_d, block_dv), fp32, tile_keys)
    split = num_splits > 1
    if split:
        opart = torch.empty((t, hq, num_splits, dv), device=query.device, dtype=torch.float32)
        lse = torch.empty((t, hq, num_splits), device=query.device, dtype=torch.float32)
    else:
        opart = lse = out  # unused
    ks, vs = key_cache.stride(), value_cache.stride()
    alibi = alibi_slopes if alibi_slopes is not None else query
    kvq = torch.stack(quant) if is_quant else query
    _decode_split_kernel[(t, hkv, num_splits)](
        query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, alibi, out, opart, lse, kvq,
        b, m, nb, bs, seg_len, score_scale(softmax_scale, softcap), window, float(softcap),
        *query.stride(), *ks, *vs, *block_table.stride(), *out.stride(),
        G=g, D=d, DV=dv, BLOCK_H=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, HAS_ALIBI=alibi_slopes is not None,
        F32=dots_in_fp32(query.dtype) or is_quant, SPLIT=split, QUANT=is_quant, WINDOW=window > 0,
        SOFTCAP=softcap > 0, num_warps=warps, **({"num_stages": stages} if stages else {}),
    )
    if split:
        _decode_reduce_kernel[(t, hq)](
            opart, lse, out, num_splits, *out.stride(),
            DV=dv, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_DV=block_dv, num_warps=4,
        )
