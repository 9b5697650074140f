"""Varlen causal flash attention, over the paged KV cache or over packed K/V without a cache.

Algorithm. One program per (tile of BLOCK_M query rows, sequence b, query head h); kv head
h // G (GQA). Sequence b owns query rows cu[b]:cu[b+1] (n of them) and kv_len keys: kv_len =
kv_seq_len[b] over the paged cache (history, then the n new tokens, already in the cache), or
n over packed K/V (prefill without a cache). Query row i sits at position kv_len - n + i
(bottom-right aligned causality) and sees keys 0..its position. The program walks keys 0 up to
the last position any of its rows sees, BLOCK_N at a time, and keeps an online softmax (running
max / sum, fp32 accumulator). Paged keys are gathered per key through the block table, so any
block size works (smaller or larger than BLOCK_N). With a sliding window W a row sees only keys
position - W + 1 .. position: the walk starts at the first key the tile's first row sees, and the
rest is masked. A soft cap bends the scores before the mask (attention_common.soft_cap).
With SPLIT (`mask_split`; no window) the walk has two parts: the key tiles that every row of the
program sees in full (up to its first row's position, on a BLOCK_N boundary) fold their scores in
without building the causal mask, and only the tiles at the diagonal build and apply one.
Tiles past a sequence's end exit at once:
the grid is sized by max_q_seq_len and B (upper bounds), never by values read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlinfer.vendor.kv_layouts import canonical
from dlinfer.vendor.triton._common import cast_to, hopper
from dlinfer.vendor.triton.attention_common import (
    block_dim,
    dots_in_fp32,
    online_softmax_step,
    paged_slots,
    score_scale,
    soft_cap,
)


@triton.jit
def _kv_tile(k_ptr, v_ptr, bt_row, s_btm, start, key_end, q_start, T, M, NB, BS, kvh,
             s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, dk, dv, k_sc, k_zp, v_sc, v_zp,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, F32: tl.constexpr,
             QUANT: tl.constexpr):
    """Key positions start..start+BLOCK_N-1 -> (pos [N], valid [N], k [N, BLOCK_D], v [N, BLOCK_DV]),
    gathered through the block table (PAGED) or from packed K/V, dequantised / upcast as the dots
    take them; invalid keys load 0."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < key_end
    if PAGED:
        blk, slot = paged_slots(bt_row, s_btm, pos, valid, BS, M, NB)
        k_off = blk * s_kb + slot * s_ks
        v_off = blk * s_vb + slot * s_vs
    else:
        key_tok = (q_start + pos).to(tl.int64)
        valid = valid & (key_tok >= 0) & (key_tok < T)
        k_off = key_tok * s_ks
        v_off = key_tok * s_vs
    k = tl.load(k_ptr + (k_off + kvh * s_kh)[:, None] + dk[None, :] * s_kd,
                mask=valid[:, None] & (dk < D)[None, :], other=0.0)
    v = tl.load(v_ptr + (v_off + kvh * s_vh)[:, None] + dv[None, :] * s_vd,
                mask=valid[:, None] & (dv < DV)[None, :], other=0.0)
    if QUANT:  # dequantised in registers (F32 is set with QUANT)
        k = (k.to(tl.float32) - k_zp) * k_sc
        v = (v.to(tl.float32) - v_zp) * v_sc
    elif F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return pos, valid, k, v


@triton.jit
def _scores(q, k, pos, q_pos, qk_scale, softcap, slope, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """q [BLOCK_M, D] . k [BLOCK_N, D] -> scores [BLOCK_M, BLOCK_N] in log2 units (soft cap, ALiBi)."""
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if SOFTCAP:
        qk = soft_cap(qk, softcap)
    if HAS_ALIBI:
        qk += slope * (pos[None, :] - q_pos[:, None]).to(tl.float32)
    return qk


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, kvlen_ptr, alibi_ptr, out_ptr, kvq_ptr,
    T, M, NB, BS, HKV, qk_scale, window, softcap,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,  # paged: (block, slot, head, dim); packed: (-, token, head, dim)
    s_vb, s_vs, s_vh, s_vd,
    s_btb, s_btm,
    s_ot, s_oh, s_od,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr, HAS_ALIBI: tl.constexpr, F32: tl.constexpr, QUANT: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SPLIT: tl.constexpr,
):
    mt = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) causal tiles start first
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q_start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - q_start
    if mt * BLOCK_M >= n:
        return
    if PAGED:
        kv_len = tl.load(kvlen_ptr + b)
        key_limit = tl.minimum(kv_len, M * BS)  # never past the block table
    else:
        kv_len = n
        key_limit = n
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = kv_len - n + rows
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    tok = (q_start + rows).to(tl.int64)
    row_ok = (rows < n) & (tok >= 0) & (tok < T)  # bad cu_seqlens_q never reach past the query
    q = tl.load(q_ptr + tok[:, None] * s_qt + h * s_qh + dk[None, :] * s_qd,
                mask=row_ok[:, None] & (dk < D)[None, :], other=0.0)
    if F32:
        q = q.to(tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + h) * 1.4426950408889634

    k_sc = 0.0  # (unused unless QUANT)
    k_zp = 0.0
    v_sc = 0.0
    v_zp = 0.0
    if QUANT:  # int8 caches: per-kv-head scale / zero ([4, Hkv] float32: k_scale, k_zero, v_scale, v_zero)
        k_sc = tl.load(kvq_ptr + kvh)
        k_zp = tl.load(kvq_ptr + HKV + kvh)
        v_sc = tl.load(kvq_ptr + 2 * HKV + kvh)
        v_zp = tl.load(kvq_ptr + 3 * HKV + kvh)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    key_end = tl.minimum(key_limit, kv_len - n + (mt + 1) * BLOCK_M)  # causal: last row's position + 1
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    key_begin = 0
    if WINDOW:  # the first key the tile's first row sees, on a BLOCK_N boundary
        key_begin = tl.maximum(kv_len - n + mt * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    full_end = key_begin  # keys key_begin..full_end-1: seen by every row of the tile (SPLIT)
    if SPLIT and not WINDOW:
        seen_by_all = tl.minimum(key_end, kv_len - n + mt * BLOCK_M + 1)  # through the first row's position
        if not PAGED:  # keys past the packed tensor (bad cu_seqlens_q) stay with the masked part
            seen_by_all = tl.where(q_start >= 0, tl.minimum(seen_by_all, T - q_start), 0)
        full_end = tl.maximum(seen_by_all // BLOCK_N * BLOCK_N, key_begin)
        for start in range(key_begin, full_end, BLOCK_N):
            pos, valid, k, v = _kv_tile(k_ptr, v_ptr, bt_row, s_btm, start, key_end, q_start, T, M, NB, BS, kvh,
                                        s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, dk, dv, k_sc, k_zp, v_sc,
                                        v_zp, D, DV, BLOCK_N, PAGED, F32, QUANT)
            qk = _scores(q, k, pos, q_pos, qk_scale, softcap, slope, SOFTCAP, HAS_ALIBI)
            # valid is all true here; the select keeps the masked walk's instruction boundary between
            # the scale's multiply and the max's subtraction, which a GPU compiler would otherwise fuse
            # into one fma here only (Triton fuses by default): the same bits in both walks
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, F32)
    for start in range(full_end, key_end, BLOCK_N):
        pos, valid, k, v = _kv_tile(k_ptr, v_ptr, bt_row, s_btm, start, key_end, q_start, T, M, NB, BS, kvh,
                                    s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, dk, dv, k_sc, k_zp, v_sc, v_zp,
                                    D, DV, BLOCK_N, PAGED, F32, QUANT)
        qk = _scores(q, k, pos, q_pos, qk_scale, softcap, slope, SOFTCAP, HAS_ALIBI)
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(allowed, qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, F32)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees no key (bad metadata): 0
    tl.store(out_ptr + tok[:, None] * s_ot + h * s_oh + dv[None, :] * s_od, cast_to(o, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dv < DV)[None, :])


def _tiles(max_q: int, max_kv: int, d: int, dv: int, fp32: bool, wide: bool = False):
    """(BLOCK_M, BLOCK_N, num_stages, num_warps). Head dims up to 128: 128 query rows x 64 keys; at
    head dim 128 exactly, x 128 keys when `wide` (`hopper()`, fp16 / bf16: the H200's tiles step
    measured it 1.04-1.06x faster in three runs, docs/gpu.md, with Triton 3.7.1 compiling it to a
    1.6 KB spill for sm_90; for sm_80 the spill would be ~32 KB); up to 256: 64 x 32; above (MLA's
    576 and 512): 32 x 16; fp32 (twice the bytes, IEEE dots without tensor cores): half as tall and
    wide, 16 x 16 at least, one stage for head dims above 256. Tiles never far above the longest
    sequence (>= 16 for tl.dot). 8 warps, except 4 for fp16/bf16 tiles of fewer than 64 rows with
    head dims up to 128. Chosen so that every launch fits the shared memory of its target (sm_80
    without `wide`), checked without a GPU by scripts/triton_targets.py
    (tests/vendor/triton/test_triton_targets.py). Registers depend on the compiler: on the H200
    (Triton 3.6) the 128 x 64 bf16 tile at D 128 ran with 176 registers (Nsight Compute); Triton
    3.7.1 compiles it to 255 and a 572-byte spill for sm_90 (docs/gpu.md)."""
    d_tile = max(block_dim(d), block_dim(dv))
    block_m, block_n = (128, 64) if d_tile <= 128 else (64, 32) if d_tile <= 256 else (32, 16)
    if wide and not fp32 and max(d, dv) == 128:  # measured at D = 128 only
        block_n = 128
    if fp32:
        block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
    stages = 1 if fp32 and d_tile > 256 else 2
    block_m = min(block_m, max(16, triton.next_power_of_2(max(1, max_q))))
    block_n = min(block_n, max(16, triton.next_power_of_2(max(1, max_kv))))
    return block_m, block_n, stages, (8 if fp32 or d_tile > 128 or block_m >= 64 else 4)


def mask_split() -> bool:
    """Whether the kernel walks the keys every row sees without a mask (module docstring). Off
    until a GPU has timed it: benchmarks/gpu_tile_sweep.py replaces this function to do so."""
    return False


def _launch(query, k, v, bt, cu, kvlen, max_q, max_kv, softmax_scale, alibi_slopes, out, ks, vs, hkv,
            m, nb, bs, paged, quant=(None, None, None, None), window=0, softcap=0.0):
    t, hq, d = query.shape
    dv = out.shape[-1]
    b = cu.shape[0] - 1
    if t == 0:
        return
    if b <= 0 or max_q <= 0:  # tokens but no sequence (bad metadata): nothing to attend to
        out.zero_()
        return
    # Rows at or past the largest cumulative end belong to no sequence (ends that stop short of T:
    # bad metadata): zero, not left unwritten. Device ops only: no host sync (CUDA-graph safe).
    rows = torch.arange(t, device=out.device)
    out.masked_fill_((rows >= cu.max()).view(t, 1, 1), 0)
    is_quant = quant[0] is not None
    f32 = dots_in_fp32(query.dtype) or is_quant
    block_m, block_n, stages, warps = _tiles(max_q, max_kv, d, dv, query.dtype == torch.float32 or is_quant,
                                        hopper(query.device))
    _prefill_kernel[(triton.cdiv(max_q, block_m), b, hq)](
        query, k, v, bt, cu, kvlen, alibi_slopes if alibi_slopes is not None else query, out,
        torch.stack(quant) if is_quant else query, t, m, nb, bs, hkv, score_scale(softmax_scale, softcap),
        window, float(softcap),
        *query.stride(), *ks, *vs, *bt.stride(), *out.stride(),
        G=hq // hkv, D=d, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_dim(d),
        BLOCK_DV=block_dim(dv), PAGED=paged, HAS_ALIBI=alibi_slopes is not None,
        F32=f32, QUANT=is_quant, WINDOW=window > 0, SOFTCAP=softcap > 0, SPLIT=mask_split(),
        num_warps=warps, num_stages=stages,
    )


def paged_prefill(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_q_seq_len,
                  max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout,
                  quant=(None, None, None, None), window=0, softcap=0.0) -> None:
    """Launcher: new tokens [T, Hq, D] over history + themselves in the paged cache -> out.
    quant: (k_scale, k_zero, v_scale, v_zero) [Hkv] float32 for int8 caches, or Nones.
    window, softcap: sliding window and soft cap (0: none)."""
    key_cache, value_cache = canonical(key_cache, kv_layout), canonical(value_cache, kv_layout)  # [NB, BS, Hkv, D]
    nb, bs, hkv = key_cache.shape[:3]
    _launch(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_q_seq_len, max_kv_seq_len,
            softmax_scale, alibi_slopes, out, key_cache.stride(), value_cache.stride(), hkv, block_table.shape[1],
            nb, bs, paged=True, quant=quant, window=window, softcap=softcap)


def prefill(query, key, value, cu_seqlens_q, max_q_seq_len, softmax_scale, alibi_slopes, out, window=0,
            softcap=0.0) -> None:
    """Launcher: packed query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv] -> out; no cache."""
    ks = (0, key.stride(0), key.stride(1), key.stride(2))
    vs = (0, value.stride(0), value.stride(1), value.stride(2))
    # kv_seq_len / block table unused when not paged: any int32 tensor stands in.
    _launch(query, key, value, cu_seqlens_q.view(1, -1), cu_seqlens_q, cu_seqlens_q, max_q_seq_len,
            max_q_seq_len, softmax_scale, alibi_slopes, out, ks, vs, key.shape[1], 1, 1, 1, paged=False,
            window=window, softcap=softcap)
