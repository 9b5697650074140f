"""Independent float64 references for the dlinfer op contract (docs/design.md, docs/ops.md).

Written from the math alone: plain loops per sequence, per head and per token, dense attention
per sequence, a per-token gather from the paged cache. Nothing here imports dlinfer's ops or
vendors; the quantised ops' references live in reference_quant.py and are re-exported here. Every
function returns float64 tensors on the CPU (or exact copies, for the cache writes), except
where the contract fixes an integer or rounding step, which is then spelled out.
"""

import math

import torch

from dlinfer.conformance._ref_base import F64, _f64, _ints, _round_half_even, add_rms_norm, rms_norm, silu  # noqa: F401  (shared helpers, and the norms)
from dlinfer.conformance.reference_quant import (  # noqa: F401  (the quantised ops' references)
    AWQ_ORDER,
    add_rms_norm_w8a8,
    awq_unpack,
    dynamic_quant,
    fused_moe_w8a8,
    int8_product,
    linear_w8a8,
    linear_w8a8_static,
    rms_norm_w8a8,
    weight_quant_matmul,
)

# ---------------------------------------------------------------- rotary


def apply_rotary_pos_emb_interleaved(x, cos, sin, return_native_layout):
    """Adjacent pairs (x[2i], x[2i+1]) of x [T, H, D] rotated by angle i, whose cos / sin sit at
    entries i (and i + D/2) of cos / sin [T, D]; float64, per pair, written out from the math:
    (a, b) -> (a cos - b sin, b cos + a sin). Native layout: all a' then all b'."""
    v = _f64(x)
    T, H, D = v.shape
    c, s = _f64(cos).reshape(T, D), _f64(sin).reshape(T, D)
    out = torch.empty_like(v)
    for i in range(D // 2):
        a, b = v[..., 2 * i], v[..., 2 * i + 1]
        ci, si = c[:, i:i + 1], s[:, i:i + 1]
        first, second = a * ci - b * si, b * ci + a * si
        if return_native_layout:
            out[..., i], out[..., D // 2 + i] = first, second
        else:
            out[..., 2 * i], out[..., 2 * i + 1] = first, second
    return out


def apply_rotary_pos_emb(query, key, cos, sin):
    """Rotate-half RoPE over the first R dims of each head, the rest passes through.

    query [..., T, Hq, D], key [..., T, Hkv, D] (a leading batch dim of 1 allowed), cos/sin [T, R].
    """

    def one(x):
        x = _f64(x)
        c = _f64(cos).reshape(-1, cos.shape[-1])
        s = _f64(sin).reshape(-1, sin.shape[-1])
        R = c.shape[-1]
        half = R // 2
        out = x.clone()
        lead = x.shape[:-3]
        batch = math.prod(lead)
        xt = x.reshape(batch, *x.shape[-3:])  # [batch, T, H, D]
        ot = out.reshape(batch, *x.shape[-3:])
        for b in range(xt.shape[0]):
            for t in range(xt.shape[1]):
                x1 = xt[b, t, :, :half]
                x2 = xt[b, t, :, half:R]
                ot[b, t, :, :half] = x1 * c[t, :half] - x2 * s[t, :half]
                ot[b, t, :, half:R] = x2 * c[t, half:] + x1 * s[t, half:]
        return ot.reshape(*lead, *x.shape[-3:])

    return one(query), one(key)


# ---------------------------------------------------------------- activations, linear, moe


def silu_and_mul(input_tensor, dim=-1):
    x = _f64(input_tensor)
    n = x.shape[dim] // 2
    a, b = torch.split(x, n, dim=dim)
    return silu(a) * b


def linear(x, weight, bias=None):
    out = _f64(x) @ _f64(weight).T
    if bias is not None:
        out = out + _f64(bias)
    return out


def moe_gating_topk_softmax(router_logits, topk):
    """softmax over experts, then per row the K largest, descending, ties to the lower id."""
    probs = torch.softmax(_f64(router_logits), dim=-1)
    T = probs.shape[0]
    weights = torch.zeros(T, topk, dtype=F64)
    ids = torch.zeros(T, topk, dtype=torch.int64)
    for t in range(T):
        row = probs[t].tolist()
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:topk]
        ids[t] = torch.tensor(order, dtype=torch.int64)
        weights[t] = torch.tensor([row[e] for e in order], dtype=F64)
    return weights, ids


def fused_moe(hidden_states, gate_up_weights, down_weights, topk_weights, topk_ids, renormalize):
    x = _f64(hidden_states)
    gu = _f64(gate_up_weights)
    dn = _f64(down_weights)
    w = _f64(topk_weights)
    ids = topk_ids.detach().cpu().to(torch.int64)
    I = gu.shape[1] // 2
    T, H = x.shape
    out = torch.zeros(T, dn.shape[1], dtype=F64)
    for t in range(T):
        wt = w[t]
        if renormalize:
            wt = wt / wt.sum()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g = gu[e, :I] @ x[t]
            u = gu[e, I:] @ x[t]
            out[t] += wt[k] * (dn[e] @ (silu(g) * u))
    return out


# ---------------------------------------------------------------- kv cache


def cache_slot_view(cache, slot, block_size, layout):
    """The [H, D] view of one token slot in a per-layer cache of the given layout."""
    block, off = divmod(slot, block_size)
    if layout == "token_major":  # [NB, BS, H, D]
        return cache[block, off]
    if layout == "head_major":  # [NB, H, BS, D]
        return cache[block, :, off]
    raise ValueError(layout)


def fill_kv_cache(key, value, key_cache, value_cache, kv_indices, layout):
    """Expected caches after the write: exact copies, token by token."""
    kc = key_cache.detach().cpu().clone()
    vc = value_cache.detach().cpu().clone()
    bs = kc.shape[1] if layout == "token_major" else kc.shape[2]
    k = key.detach().cpu()
    v = value.detach().cpu()
    for t, slot in enumerate(_ints(kv_indices)):
        cache_slot_view(kc, slot, bs, layout).copy_(k[t])
        cache_slot_view(vc, slot, bs, layout).copy_(v[t])
    return kc, vc


def quantise_kv(x, scale, zero):
    """The int8 KV cache's write: x [T, H, D], scale / zero [H] (float32 values) -> int8 [T, H, D]
    = clamp(round_half_even(x / scale + zero), -128, 127), with the contract's float32 steps:
    the float32 quotient (float64 rounded once to float32: correctly rounded, as in dynamic_quant),
    then the float32 sum (float64 sum, exact for these magnitudes, rounded once)."""
    f32 = torch.float32
    s = _f64(scale).view(1, -1, 1)
    z = _f64(zero).view(1, -1, 1)
    ratio = (_f64(x.float()) / s).to(f32).to(F64)
    shifted = (ratio + z).to(f32).to(F64)
    return _round_half_even(shifted).clamp(-128.0, 127.0).to(torch.int8)


def fill_kv_cache_int8(key, value, key_cache, value_cache, kv_indices, layout, k_scale, k_zero, v_scale, v_zero):
    """Expected int8 caches after a quantised write: `quantise_kv`'d rows, token by token."""
    return fill_kv_cache(quantise_kv(key, k_scale, k_zero), quantise_kv(value, v_scale, v_zero),
                         key_cache.view(torch.int8), value_cache.view(torch.int8), kv_indices, layout)


def dequantise_cache(cache, scale, zero, layout):
    """An int8 (or uint8, read as int8) per-layer cache -> float64 (q - zero[h]) * scale[h]."""
    q = _f64(cache.view(torch.int8))
    shape = (1, 1, -1, 1) if layout == "token_major" else (1, -1, 1, 1)
    return (q - _f64(zero).view(shape)) * _f64(scale).view(shape)


def slot_rows(cache, slots, block_size, layout):
    """Advanced-indexing arguments for token slots: cache[slot_rows(...)] is [n, H, D], row i the
    cache's row of slots[i] (a gathered copy on read, a scatter on assignment)."""
    slots = torch.as_tensor(slots, dtype=torch.int64, device=cache.device)
    block, off = slots // block_size, slots % block_size
    if layout == "token_major":  # [NB, BS, H, D]
        return block, off
    if layout == "head_major":  # [NB, H, BS, D]: the slice between the two index tensors puts n first
        return block, slice(None), off
    raise ValueError(layout)


def gather_paged(cache, block_table_row, kv_len, block_size, layout):
    """The first kv_len positions of one sequence -> [kv_len, H, D] float64: position p sits in
    the sequence's block p // block_size at offset p % block_size."""
    blocks = torch.tensor(_ints(block_table_row), dtype=torch.int64)
    pos = torch.arange(kv_len, dtype=torch.int64)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    return _f64(cache[slot_rows(cache, slots, block_size, layout)].detach().cpu())


# ---------------------------------------------------------------- attention


def attention_one_sequence(q, k, v, q_pos, softmax_scale=None, alibi_slopes=None, window=0, softcap=0.0):
    """Dense attention of one sequence.

    q [n, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv]; q_pos[i] is query i's position; it attends to
    keys 0..q_pos[i] (inclusive), and with a window W > 0 only to keys q_pos[i] - W + 1 ..
    q_pos[i]. ALiBi adds slope_h * (key_pos - query_pos) (<= 0); a soft cap c replaces each
    scaled score s by c * tanh(s / c) (before ALiBi and the mask).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    n, Hq, D = q.shape
    L, Hkv, Dv = v.shape
    group = Hq // Hkv
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    slopes = None if alibi_slopes is None else _f64(alibi_slopes).tolist()
    out = torch.zeros(n, Hq, Dv, dtype=F64)
    if n == 0:
        return out
    qp = torch.tensor(q_pos, dtype=torch.int64)
    assert int(qp.max()) < L, "a query position past the keys"
    kp = torch.arange(L, dtype=torch.int64)
    visible = kp[None, :] <= qp[:, None]  # [n, L]
    if window:
        visible &= kp[None, :] > qp[:, None] - window
    rel = (kp[None, :] - qp[:, None]).to(F64)  # key_pos - query_pos
    for h in range(Hq):
        kh, vh = k[:, h // group], v[:, h // group]
        scores = (q[:, h] @ kh.T) * scale  # [n, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if slopes is not None:
            scores = scores + slopes[h] * rel
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def prefill_attention(query, key, value, q_seq_len, softmax_scale=None, alibi_slopes=None, window=0, softcap=0.0):
    """No history: per-sequence lengths (q_seq_len [B]); causal inside each sequence."""
    T, Hq, _ = query.shape
    out = torch.zeros(T, Hq, value.shape[-1], dtype=F64)
    start = 0
    for n in _ints(q_seq_len):
        sl = slice(start, start + n)
        out[sl] = attention_one_sequence(query[sl], key[sl], value[sl], list(range(n)),
                                         softmax_scale, alibi_slopes, window, softcap)
        start += n
    assert start == T, (start, T)
    return out


def paged_attention(query, key_cache, value_cache, block_table, block_size, q_cu_ends, kv_seq_len,
                    layout, softmax_scale=None, alibi_slopes=None, window=0, softcap=0.0):
    """Paged prefill and decode: q_cu_ends [B] are cumulative ends of the query rows.

    New token i of sequence b (n_b new tokens) sits at kv_seq_len[b] - n_b + i.
    """
    T, Hq, _ = query.shape
    Dv = value_cache.shape[-1]
    out = torch.zeros(T, Hq, Dv, dtype=F64)
    ends = _ints(q_cu_ends)
    kv_lens = _ints(kv_seq_len)
    start = 0
    for b, (end, L) in enumerate(zip(ends, kv_lens)):
        n = end - start
        k = gather_paged(key_cache, block_table[b], L, block_size, layout)
        v = gather_paged(value_cache, block_table[b], L, block_size, layout)
        q_pos = [L - n + i for i in range(n)]
        out[start:end] = attention_one_sequence(query[start:end], k, v, q_pos, softmax_scale, alibi_slopes, window,
                                                softcap)
        start = end
    assert start == T, (start, T)
    return out


def alibi_slopes(num_heads):
    """The standard ALiBi slopes (Press et al.; HF Bloom's build_alibi_tensor)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        n_extra = num_heads - closest
        slopes += [extra_base ** (2 * i + 1) for i in range(n_extra)]
    return torch.tensor(slopes, dtype=torch.float32)
