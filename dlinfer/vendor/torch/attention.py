"""Attention in PyTorch on top of scaled_dot_product_attention (SDPA).

prefill_attention: one SDPA per sequence (causal, no cache).
paged_prefill_attention: per sequence, gather its blocks from the cache, one SDPA with a
    bottom-right causal mask (the new tokens are the last n of the sequence's kv_len positions).
paged_decode_attention: batched: every query token gathers the blocks of its sequence (padded to
    max_kv_seq_len), one SDPA call for the whole batch with a per-token length mask.
Scores and softmax run in fp32 inside SDPA for every dtype.
"""

import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dlinfer.ops._memo import LastCallMemo
from dlinfer.vendor.base import HEAD_MAJOR


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, causal: bool) -> Tensor:
    """q [..., Hq, Lq, D], k [..., Hkv, Lk, D], v [..., Hkv, Lk, Dv] -> [..., Hq, Lq, Dv]."""
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def _mask(q_pos: Tensor, k_len: int, alibi: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """Mask for queries at absolute positions q_pos [..., Lq] over keys 0..k_len-1.

    Boolean [..., 1, Lq, Lk] without ALiBi; with slopes [Hq] an additive float mask
    [..., Hq, Lq, Lk] holding slope * (key_pos - query_pos) where allowed and -inf elsewhere.
    """
    k_pos = torch.arange(k_len, device=q_pos.device)
    rel = k_pos - q_pos.unsqueeze(-1).long()  # [..., Lq, Lk]; allowed where <= 0
    allowed = (rel <= 0).unsqueeze(-3)
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


def _gather(cache: Tensor, blocks: Tensor, kv_layout: str, scratch: Optional[str] = None, dead=None) -> Tensor:
    """cache blocks [..., nb] -> [..., Hkv, nb*BS, D] (copied; into a scratch buffer if named).

    dead: optional (token, block, offset) indices of masked positions to zero in the copy.
    """
    lead, nblk = blocks.shape[:-1], blocks.shape[-1]
    flat_blocks = blocks.reshape(-1)
    if cache.is_contiguous():
        rows = cache.view(cache.shape[0], -1)
        out = None
        if scratch is not None:
            out = _scratch_buffer(scratch, flat_blocks.numel() * rows.shape[1], cache.dtype, cache.device)
            out = out.view(flat_blocks.numel(), rows.shape[1])
        g = torch.index_select(rows, 0, flat_blocks, out=out) if out is not None else torch.index_select(
            rows, 0, flat_blocks)
        g = g.view(*lead, nblk, *cache.shape[1:])
    else:
        g = cache[blocks]
    if dead is not None:
        _zero_dead(g, dead, kv_layout)
    # token_major: [..., nb, BS, H, D]; head_major: [..., nb, H, BS, D]
    if kv_layout == HEAD_MAJOR:
        g = g.transpose(-3, -4)  # [..., H, nb, BS, D]
        return g.reshape(*g.shape[:-4], g.shape[-4], -1, g.shape[-1])
    g = g.reshape(*g.shape[:-4], -1, g.shape[-2], g.shape[-1])  # [..., nb*BS, H, D]
    return g.transpose(-2, -3)


def _block_size(cache: Tensor, kv_layout: str) -> int:
    return cache.shape[2] if kv_layout == HEAD_MAJOR else cache.shape[1]


def _sdpa_dtype(x: Tensor) -> Tensor:
    # CPU SDPA kernels accumulate fp16 poorly; run fp16 through fp32 there.
    return x.float() if x.dtype == torch.float16 and x.device.type == "cpu" else x


def prefill_attention(query, key, value, cu_seqlens_q, max_q_seq_len, softmax_scale, alibi_slopes, out) -> None:
    """query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv], cu_seqlens_q [B+1] -> out [T, Hq, Dv]."""
    cu = cu_seqlens_q.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        if end <= start:
            continue
        q = _sdpa_dtype(query[start:end].transpose(0, 1))
        k = _sdpa_dtype(key[start:end].transpose(0, 1))
        v = _sdpa_dtype(value[start:end].transpose(0, 1))
        if alibi_slopes is None:
            o = _sdpa(q, k, v, None, softmax_scale, causal=True)
        else:
            pos = torch.arange(end - start, device=query.device)
            o = _sdpa(q, k, v, _mask(pos, end - start, alibi_slopes, q.dtype), softmax_scale, causal=False)
        out[start:end] = o.transpose(0, 1).to(out.dtype)


def paged_prefill_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_q_seq_len,
                            max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout) -> None:
    """Each sequence's new tokens over its paged history + themselves; see the module docstring."""
    bs = _block_size(key_cache, kv_layout)
    cu, kv = cu_seqlens_q.tolist(), kv_seq_len.tolist()
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        n, kv_len = end - start, kv[b]
        if n <= 0 or kv_len <= 0:
            continue
        blocks = block_table[b, : (kv_len + bs - 1) // bs].long()
        k = _sdpa_dtype(_gather(key_cache, blocks, kv_layout)[:, :kv_len])
        v = _sdpa_dtype(_gather(value_cache, blocks, kv_layout)[:, :kv_len])
        q = _sdpa_dtype(query[start:end].transpose(0, 1))
        pos = torch.arange(kv_len - n, kv_len, device=query.device)
        o = _sdpa(q, k, v, _mask(pos, kv_len, alibi_slopes, q.dtype), softmax_scale, causal=False)
        out[start:end] = o.transpose(0, 1).to(out.dtype)


def _decode_plan(cu_seqlens_q: Tensor, kv_seq_len: Tensor, block_table: Tensor, max_kv_seq_len: int,
                 num_tokens: int, bs: int, nb_total: int, alibi: Optional[Tensor], dtype: torch.dtype):
    """(blocks [T, nblk] to gather for each query token, attention mask) for a decode step.

    Query token t of sequence b (n_b new tokens) sits at position kv_len[b] - n_b + i and sees
    positions <= its own. Block-table entries past a sequence's last block may hold anything:
    they are clamped into the cache and masked out.
    """
    device = cu_seqlens_q.device
    tokens = torch.arange(num_tokens, device=device, dtype=torch.int32)
    ends = cu_seqlens_q[1:].contiguous()
    seq = torch.searchsorted(ends, tokens, right=True).clamp_(max=ends.numel() - 1)
    n_new = (ends - cu_seqlens_q[:-1])[seq]
    pos = kv_seq_len[seq] - n_new + (tokens - cu_seqlens_q[seq])
    num_blocks = min(max(1, (max_kv_seq_len + bs - 1) // bs), block_table.shape[1])
    blocks = block_table[seq.long(), :num_blocks].long().clamp_(0, nb_total - 1)
    mask = _mask(pos.unsqueeze(-1), num_blocks * bs, alibi, dtype)  # [T, 1|Hq, 1, L]
    if mask.dtype == torch.bool:  # SDPA would convert a boolean mask on every call
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
    # Masked positions may hold anything, NaN included, and NaN survives a -inf bias (and 0 * NaN
    # is NaN): the gathered copies of those positions are zeroed. They are the tails past each
    # token's position, few when lengths are similar, so a scatter beats a pass over the buffer.
    beyond = torch.arange(num_blocks * bs, device=device).unsqueeze(0) > pos.unsqueeze(1).long()
    dead_t, dead_l = beyond.nonzero(as_tuple=True)
    return blocks, mask, (dead_t, dead_l // bs, dead_l % bs)


def _zero_dead(g: Tensor, dead, kv_layout: str) -> None:
    """Zero the masked positions of a gathered [T, nblk, BS, H, D] (or [T, nblk, H, BS, D]) copy."""
    t_idx, blk_idx, off_idx = dead
    if t_idx.numel() == 0:
        return
    if kv_layout == HEAD_MAJOR:
        g[t_idx, blk_idx, :, off_idx] = 0
    else:
        g[t_idx, blk_idx, off_idx] = 0


# The plan is the same for every layer of a step: build it once per step.
_decode_plan_memo = LastCallMemo(_decode_plan)


def paged_decode_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len,
                           softmax_scale, alibi_slopes, out, kv_layout) -> None:
    """All query tokens at once: each gathers its sequence's blocks (padded to max_kv_seq_len),
    then one SDPA call for the batch with a per-token causal/length mask."""
    q = _sdpa_dtype(query).unsqueeze(2)  # [T, Hq, 1, D]
    blocks, mask, dead = _decode_plan_memo(cu_seqlens_q, kv_seq_len, block_table, max_kv_seq_len, query.shape[0],
                                           _block_size(key_cache, kv_layout), key_cache.shape[0], alibi_slopes,
                                           q.dtype)
    k = _sdpa_dtype(_gather(key_cache, blocks, kv_layout, "decode_k", dead))  # [T, Hkv, L, D]
    v = _sdpa_dtype(_gather(value_cache, blocks, kv_layout, "decode_v", dead))
    o = _sdpa(q, k, v, mask, softmax_scale, causal=False)  # [T, Hq, 1, Dv]
    out.copy_(o.squeeze(2))
