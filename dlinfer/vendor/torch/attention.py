"""Attention in PyTorch on top of scaled_dot_product_attention (SDPA).

prefill_attention: one SDPA per sequence (causal, no cache).
paged_prefill_attention: per sequence, gather its blocks from the cache, one SDPA with a
    bottom-right causal mask (the new tokens are the last n of the sequence's kv_len positions).
paged_decode_attention: batched: every query token gathers the cache positions it may see
    (padded to max_kv_seq_len), one SDPA call for the whole batch, masked only where lengths differ.
Scores and softmax run in fp32 inside SDPA for every dtype. A sliding window is one more mask
term; soft-capping (c * tanh(s / c) on the scaled scores) has no SDPA form, so with it the scores
are computed explicitly, in float32 (`_attend`).
"""

import threading
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dlinfer.utils.memo import LastCallMemo
from dlinfer.vendor.kv_layouts import blocks_and_size, canonical


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, causal: bool,
          softcap: float = 0.0) -> Tensor:
    """q [..., Hq, Lq, D], k [..., Hkv, Lk, D], v [..., Hkv, Lk, Dv] -> [..., Hq, Lq, Dv]."""
    if softcap:
        return _attend(q, k, v, mask, scale, causal, softcap)
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, causal: bool,
            softcap: float) -> Tensor:
    """What _sdpa computes, with the scaled scores soft-capped (c * tanh(s / c)) before the mask
    and the softmax; float32 throughout, returned in q's dtype. A row with no visible key is 0."""
    group = q.shape[-3] // k.shape[-3]
    k = k.float().repeat_interleave(group, dim=-3)
    v = v.float().repeat_interleave(group, dim=-3)
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key: all -inf -> NaN -> 0
    return torch.matmul(p, v).to(q.dtype)


def _mask(q_pos: Tensor, k_len: int, alibi: Optional[Tensor], dtype: torch.dtype, window: int = 0) -> Tensor:
    """Mask for queries at absolute positions q_pos [..., Lq] over keys 0..k_len-1.

    Boolean [..., 1, Lq, Lk] without ALiBi; with slopes [Hq] an additive float mask
    [..., Hq, Lq, Lk] holding slope * (key_pos - query_pos) where allowed and -inf elsewhere.
    A key is allowed at or before the query's position and, with a window W > 0, after its
    position - W.
    """
    k_pos = torch.arange(k_len, device=q_pos.device)
    rel = k_pos - q_pos.unsqueeze(-1).long()  # [..., Lq, Lk]; allowed where <= 0
    allowed = rel <= 0
    if window:
        allowed &= rel > -window
    allowed = allowed.unsqueeze(-3)
    if alibi is None:
        return allowed
    bias = alibi.view(-1, 1, 1).float() * rel.unsqueeze(-3).float()  # [..., Hq, Lq, Lk]
    return bias.masked_fill(~allowed, float("-inf")).to(dtype if dtype != torch.float16 else torch.float32)


_scratch = threading.local()


def _scratch_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A per-thread buffer reused across calls (fresh multi-MB allocations page-fault on the CPU).

    Only for data consumed before the op returns: decode gathers K/V into it, SDPA reads it.
    """
    bufs = _scratch.__dict__.setdefault("bufs", {})
    key = (name, dtype, device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = torch.empty(numel, dtype=dtype, device=device)
        bufs[key] = buf
    return buf[:numel]


def _gather(cache: Tensor, blocks: Tensor, kv_layout: str) -> Tensor:
    """cache blocks [nb] -> [Hkv, nb*BS, D] (a copy)."""
    g = canonical(cache, kv_layout)[blocks]  # [nb, BS, Hkv, D]
    return g.reshape(-1, g.shape[-2], g.shape[-1]).transpose(0, 1)


def dequantise(x: Tensor, scale: Optional[Tensor], zero: Optional[Tensor], head_dim: int) -> Tensor:
    """An int8 tile whose dim `head_dim` is the KV head -> float32 (x - zero[h]) * scale[h];
    x itself when scale is None (an unquantised cache)."""
    if scale is None:
        return x
    shape = [1] * x.dim()
    shape[head_dim] = -1
    return (x.float() - zero.view(shape)) * scale.view(shape)


def _sdpa_dtype(x: Tensor) -> Tensor:
    # CPU SDPA kernels accumulate fp16 poorly; run fp16 through fp32 there.
    return x.float() if x.dtype == torch.float16 and x.device.type == "cpu" else x


def _sequence_rows(cu_seqlens_q: Tensor, t: int):
    """([(b, start, end)] of each sequence's query rows, clamped into [0, T) and non-empty,
    whether they cover every row exactly once). Well-formed cumulative offsets (0,
    non-decreasing, ending at T) do; bad ones (ends that decrease, stop short of T or run past
    it) may not, and the caller then zeroes the rows no sequence covers (`_zero_uncovered`)."""
    cu = cu_seqlens_q.tolist()
    well_formed = cu[0] == 0 and cu[-1] == t and all(a <= b for a, b in zip(cu[:-1], cu[1:]))
    rows = []
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        start, end = min(max(start, 0), t), min(max(end, 0), t)
        if end > start:
            rows.append((b, start, end))
    return rows, well_formed


def _zero_uncovered(out: Tensor, rows) -> None:
    """Zero the rows of out that no (b, start, end) covers. Done after the sequences ran: out may
    be a view of the query (LMDeploy passes query[..., :Dv]), which must not change before."""
    covered = torch.zeros(out.shape[0], dtype=torch.bool)
    for _, start, end in rows:
        covered[start:end] = True
    out[(~covered).to(out.device)] = 0


def prefill_attention(query, key, value, cu_seqlens_q, max_q_seq_len, softmax_scale, alibi_slopes, out,
                      sliding_window: int = 0, logit_softcapping: float = 0.0) -> None:
    """query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv], cu_seqlens_q [B+1] -> out [T, Hq, Dv]."""
    rows, well_formed = _sequence_rows(cu_seqlens_q, out.shape[0])
    for _, start, end in rows:
        q = _sdpa_dtype(query[start:end].transpose(0, 1))
        k = _sdpa_dtype(key[start:end].transpose(0, 1))
        v = _sdpa_dtype(value[start:end].transpose(0, 1))
        if alibi_slopes is None and not sliding_window:
            o = _sdpa(q, k, v, None, softmax_scale, causal=True, softcap=logit_softcapping)
        else:
            pos = torch.arange(end - start, device=query.device)
            mask = _mask(pos, end - start, alibi_slopes, q.dtype, sliding_window)
            o = _sdpa(q, k, v, mask, softmax_scale, causal=False, softcap=logit_softcapping)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    if not well_formed:
        _zero_uncovered(out, rows)


def paged_prefill_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_q_seq_len,
                            max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout, k_scale=None, k_zero=None,
                            v_scale=None, v_zero=None, sliding_window: int = 0, logit_softcapping: float = 0.0) -> None:
    """Each sequence's new tokens over its paged history + themselves; see the module docstring.
    An int8 cache (k_scale etc. [Hkv] float32) is dequantised per gathered sequence, and the
    attention then runs in float32.

    Bad metadata reads nothing outside the caches and leaves no row unwritten: block ids are
    clamped into [0, NB), a sequence's length into its block-table row (M * BS), and a query row
    with no key to see (more new tokens than the sequence's length) is zero."""
    nb, bs = blocks_and_size(key_cache, kv_layout)
    longest = block_table.shape[1] * bs
    kv = kv_seq_len.tolist()
    rows, well_formed = _sequence_rows(cu_seqlens_q, out.shape[0])
    for b, start, end in rows:
        n, kv_len = end - start, min(kv[b], longest)
        if kv_len < n:  # rows before the sequence's first position see no key
            out[start:end - max(kv_len, 0)] = 0
            start = end - max(kv_len, 0)
            n = end - start
        if n <= 0:
            continue
        blocks = block_table[b, : (kv_len + bs - 1) // bs].long().clamp(0, nb - 1)
        k = _sdpa_dtype(dequantise(_gather(key_cache, blocks, kv_layout)[:, :kv_len], k_scale, k_zero, 0))
        v = _sdpa_dtype(dequantise(_gather(value_cache, blocks, kv_layout)[:, :kv_len], v_scale, v_zero, 0))
        q = _sdpa_dtype(query[start:end].transpose(0, 1))
        q = q if k_scale is None else q.float()
        pos = torch.arange(kv_len - n, kv_len, device=query.device)
        mask = _mask(pos, kv_len, alibi_slopes, q.dtype, sliding_window)
        o = _sdpa(q, k, v, mask, softmax_scale, causal=False, softcap=logit_softcapping)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    if not well_formed:
        _zero_uncovered(out, rows)


class DecodePlan(NamedTuple):
    """What every layer of a decode step gathers: query token t reads the cache positions
    0..L-1 of its sequence at (blocks[t, j], offsets[t, j]) (slots = blocks * BS + offsets).
    Positions past the token's own repeat its own slot and are masked out; mask is None when no
    position needs masking (every token sees exactly L positions: batch 1, equal lengths)."""

    blocks: Tensor  # [T, L] int64
    offsets: Tensor  # [T, L] int64
    slots: Tensor  # [T * L] int64
    mask: Optional[Tensor]  # [T, 1|Hq, 1, L] additive float, or None


def _decode_plan(cu_seqlens_q: Tensor, kv_seq_len: Tensor, block_table: Tensor, max_kv_seq_len: int,
                 num_tokens: int, bs: int, nb_total: int, alibi: Optional[Tensor], dtype: torch.dtype,
                 window: int = 0) -> DecodePlan:
    """The DecodePlan of a step.

    Query token t of sequence b (n_b new tokens) sits at position kv_len[b] - n_b + i and sees
    positions <= its own (and, with a window W > 0, > its own - W). Only positions <= its own are
    read (padding repeats its own position), so block-table entries past a sequence's last block
    and cache slots that were never written (which may hold NaN) are never touched; indices are clamped into the cache.
    """
    device = cu_seqlens_q.device
    tokens = torch.arange(num_tokens, device=device, dtype=torch.int32)
    ends = cu_seqlens_q[1:].contiguous()
    seq = torch.searchsorted(ends, tokens, right=True).clamp_(max=ends.numel() - 1).long()
    n_new = (ends - cu_seqlens_q[:-1])[seq]
    pos = (kv_seq_len[seq] - n_new + (tokens - cu_seqlens_q[seq])).long()  # [T]
    length = max(1, min(max_kv_seq_len, block_table.shape[1] * bs))
    visible = torch.arange(length, device=device).unsqueeze(0)  # [1, L]
    read = torch.minimum(visible, pos.clamp(min=0).unsqueeze(1))  # [T, L]
    blocks = block_table[seq].long().gather(1, torch.div(read, bs, rounding_mode="floor")).clamp_(0, nb_total - 1)
    offsets = read % bs
    slots = (blocks * bs + offsets).reshape(-1)
    mask = None
    if alibi is not None or not bool((pos == length - 1).all()) or (window and length > window):
        mask = _mask(pos.unsqueeze(-1), length, alibi, dtype, window)  # [T, 1|Hq, 1, L]
        if mask.dtype == torch.bool:  # SDPA would convert a boolean mask on every call
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
    return DecodePlan(blocks, offsets, slots, mask)


def _gather_tokens(cache: Tensor, plan: DecodePlan, kv_layout: str, scratch: str) -> Tensor:
    """[T, Hkv, L, D] (a strided view of a [T, L, Hkv, D] copy) of the positions the plan reads."""
    t, length = plan.blocks.shape
    cache = canonical(cache, kv_layout)  # [NB, BS, Hkv, D]
    if cache.is_contiguous():
        rows = cache.view(-1, cache.shape[2] * cache.shape[3])  # one row per slot
        buf = _scratch_buffer(scratch, plan.slots.numel() * rows.shape[1], cache.dtype, cache.device)
        g = torch.index_select(rows, 0, plan.slots, out=buf.view(-1, rows.shape[1]))
        g = g.view(t, length, cache.shape[2], cache.shape[3])
    else:
        g = cache[plan.blocks, plan.offsets]  # [T, L, Hkv, D]
    return g.transpose(1, 2)


def _decode_dtype(x: Tensor) -> Tensor:
    # CPU SDPA is several times slower in half precision than in fp32 at decode sizes.
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) and x.device.type == "cpu" else x


# The plan is the same for every layer of a step: build it once per step.
_decode_plan_memo = LastCallMemo(_decode_plan)


def paged_decode_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len,
                           softmax_scale, alibi_slopes, out, kv_layout, k_scale=None, k_zero=None, v_scale=None,
                           v_zero=None, sliding_window: int = 0, logit_softcapping: float = 0.0) -> None:
    """All query tokens at once: each gathers the positions it may see (padded to the longest),
    then one SDPA call for the batch, masked only where lengths differ. An int8 cache (k_scale
    etc. [Hkv] float32) is dequantised after the gather, and the attention runs in float32."""
    q = _decode_dtype(query).unsqueeze(2)  # [T, Hq, 1, D]
    q = q if k_scale is None else q.float()
    plan = _decode_plan_memo(cu_seqlens_q, kv_seq_len, block_table, max_kv_seq_len, query.shape[0],
                             blocks_and_size(key_cache, kv_layout)[1], key_cache.shape[0], alibi_slopes, q.dtype,
                             sliding_window)
    k = _decode_dtype(dequantise(_gather_tokens(key_cache, plan, kv_layout, "decode_k"), k_scale, k_zero, 1))
    v = _decode_dtype(dequantise(_gather_tokens(value_cache, plan, kv_layout, "decode_v"), v_scale, v_zero, 1))
    o = _sdpa(q, k, v, plan.mask, softmax_scale, causal=False, softcap=logit_softcapping)  # [T, Hq, 1, Dv]
    out.copy_(o.squeeze(2))
