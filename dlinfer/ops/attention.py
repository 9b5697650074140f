"""Attention: varlen prefill without a cache, and prefill / decode over the paged KV cache.

Sequence lengths follow LMDeploy 0.18's calls (docs/design.md, "Lengths and positions"):
  prefill_attention: q_seq_len = per-sequence lengths [B].
  paged_prefill_attention, paged_decode_attention: q_seq_len = cumulative END offsets [B]
  (cu_seqlens_q[1:]): sequence b owns query rows q_seq_len[b-1] : q_seq_len[b].
New token i of sequence b (n_b new tokens) sits at position kv_seq_len[b] - n_b + i and attends to
every cached position up to and including its own.

Two optional arguments, set per layer (Gemma 2/3 alternate windowed and global layers), change
the scores (docs/design.md, "Sliding windows and soft-capping"):
  sliding_window W: a token at position p sees only positions p - W + 1 .. p (its last W keys,
      itself included: transformers' convention). None or -1 (LMDeploy's "no window"): no window.
  logit_softcapping c: each score s (after the softmax scale) becomes c * tanh(s / c) before the
      softmax (Gemma 2). None or 0: none.
A vendor runs them when it declares FEATURE_SLIDING_WINDOW / FEATURE_SOFTCAP; its kernel then
gets `sliding_window=` / `logit_softcapping=` keywords, and only when they are set.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from dlinfer.errors import InvalidArgumentError
from dlinfer.ops import _attention_args as AA
from dlinfer.ops import _checks as C
from dlinfer.ops import kv_quant
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, check_head_dim, int_arg, kernel_for
from dlinfer.ops.kv_cache import cache_dims, token_rows
from dlinfer.vendor import kv_layouts
from dlinfer.vendor.selection import kv_layout as active_kv_layout


def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Optional[Tensor],
    value_cache: Optional[Tensor],
    q_seq_len: Tensor,
    kv_seq_len: Tensor,
    max_q_seq_len: Optional[int],
    num_q_heads: int,
    num_kv_heads: int,
    attn_mask: Sequence = (),
    softmax_scale: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    attn_output: Optional[Tensor] = None,
    actual_seq_lengths_cpu: Optional[Tensor] = None,
    sliding_window: Optional[int] = None,
    logit_softcapping: Optional[float] = None,
) -> Tensor:
    """Causal varlen attention over the new tokens alone (no history).

    query: [T, Hq, D]; key: [T, Hkv, D]; value: [T, Hkv, Dv] (packed sequences, no padding).
    key_cache, value_cache: unused (LMDeploy passes them; the K/V already went through fill_kv_cache).
    q_seq_len: [B] per-sequence lengths, int32/int64, on the CPU or query's device.
    kv_seq_len: [B], equal to q_seq_len (no history).
    max_q_seq_len: upper bound of q_seq_len (None: T).
    num_q_heads = Hq, num_kv_heads = Hkv (Hq % Hkv == 0).
    attn_mask: ignored (causality is implied); LMDeploy passes an empty list.
    softmax_scale: default D ** -0.5.  alibi_slopes: [Hq] float32 or None.
    attn_output: optional [T, Hq, Dv] (may be a strided view such as query[..., :Dv]); WRITTEN.
    actual_seq_lengths_cpu: optional [B] cumulative ends on the CPU (saves a cumsum).
    sliding_window, logit_softcapping: see the module docstring (None: off).
    Returns attn_output (or a new [T, Hq, Dv] tensor).
    """
    args = (query, key, value, q_seq_len, kv_seq_len, max_q_seq_len, num_q_heads, num_kv_heads, softmax_scale,
            alibi_slopes, attn_output, actual_seq_lengths_cpu, sliding_window, logit_softcapping)
    kernel = (_check_prefill(*args) if not torch.compiler.is_compiling()
              else checked("prefill_attention", _check_prefill, *args))
    query = token_rows(query)
    t, hq, d = query.shape
    key, value = key.view(t, key.shape[-2], d), token_rows(value)
    max_q = t if max_q_seq_len is None else int_arg(max_q_seq_len)
    scale = AA.scale_value(softmax_scale, d)
    options = AA.option_kwargs(sliding_window, logit_softcapping)
    out = token_rows(attn_output) if attn_output is not None else query.new_empty((t, hq, value.shape[2]))
    cu = AA.prefill_lengths(q_seq_len, actual_seq_lengths_cpu, query.device)
    if C.check_values_enabled():
        _check_prefill_values(cu, q_seq_len, kv_seq_len, actual_seq_lengths_cpu, max_q, t)
    if t == 0:
        return out
    kernel(query, key, value, cu, max_q, scale, alibi_slopes, out, **options)
    return out


def _check_prefill(query, key, value, q_seq_len, kv_seq_len, max_q_seq_len, num_q_heads, num_kv_heads,
                   softmax_scale, alibi_slopes, attn_output, actual_seq_lengths_cpu, sliding_window,
                   logit_softcapping):
    """Checks prefill_attention's arguments (metadata only); returns the vendor's function."""
    op = "prefill_attention"
    query = AA.check_query(op, query)
    t, hq, d = query.shape
    hkv = AA.check_heads(op, query, num_q_heads, num_kv_heads)
    key, value = token_rows(key), token_rows(value)
    C.tensor(op, "key", key, (t, hkv, d), C.FLOAT_DTYPES, query.device)
    C.tensor(op, "value", value, (t, hkv, "Dv"), C.FLOAT_DTYPES, query.device)
    C.same_dtype(op, "key", key, query, "query")
    C.same_dtype(op, "value", value, query, "query")
    C.length_tensor(op, "q_seq_len", q_seq_len, "B", query.device)
    b = q_seq_len.shape[0]
    C.length_tensor(op, "kv_seq_len", kv_seq_len, b, query.device)
    if actual_seq_lengths_cpu is not None:
        C.length_tensor(op, "actual_seq_lengths_cpu", actual_seq_lengths_cpu, b, query.device)
    if max_q_seq_len is not None:
        C.integer(op, "max_q_seq_len", max_q_seq_len, 0)
    kernel, vendor = kernel_for(op, query.device)
    check_dtype(vendor, op, query.dtype)
    check_head_dim(vendor, op, d)
    AA.check_scale(op, softmax_scale)
    AA.check_alibi(op, vendor, alibi_slopes, query)
    AA.check_score_options(op, vendor, sliding_window, logit_softcapping)
    if attn_output is not None:
        AA.check_output(op, query, value.shape[2], attn_output)
    return kernel


def _check_prefill_values(cu: Tensor, q_seq_len: Tensor, kv_seq_len: Tensor, actual_seq_lengths_cpu, max_q: int,
                          t: int) -> None:
    """prefill_attention's lengths against each other and T (DLINFER_CHECK_VALUES=1; a device sync)."""
    op = "prefill_attention"
    AA.check_cu_values(op, "q_seq_len" if actual_seq_lengths_cpu is None else "actual_seq_lengths_cpu", cu, t)
    if actual_seq_lengths_cpu is not None and not torch.equal(
            torch.cumsum(q_seq_len.cpu().long(), 0), actual_seq_lengths_cpu.cpu().long()):
        raise InvalidArgumentError(op, "actual_seq_lengths_cpu", "the cumulative sum of q_seq_len",
                                   str(actual_seq_lengths_cpu.tolist()))
    if not torch.equal(q_seq_len.cpu().long(), kv_seq_len.cpu().long()):
        raise InvalidArgumentError(op, "kv_seq_len", "equal to q_seq_len (no history)", str(kv_seq_len.tolist()))
    if q_seq_len.shape[0] and int(q_seq_len.max()) > max_q:
        raise InvalidArgumentError(op, "max_q_seq_len", f">= {int(q_seq_len.max())}", str(max_q))


class _Paged(NamedTuple):
    """What both paged attention ops need once their shared arguments are checked."""
    kernel: Callable  # the vendor's function for the op
    query: Tensor  # [T, Hq, D], as the kernel reads it
    caches: Tuple[Tensor, Tensor]  # key and value caches (int8 views of uint8 int8 caches)
    layout: str  # the active KV layout
    cu: Tensor  # [B + 1] cumulative new-token offsets
    kv: Tensor  # [B] history + new tokens per sequence
    scale: float  # the softmax scale
    alibi: Optional[Tensor]  # [Hq] float32 slopes or None
    out: Tensor  # [T, Hq, Dv], written by the kernel
    check_values: bool  # whether value checks are on
    quant: "kv_quant.KVQuant"  # the int8 cache's scales and zeros (NO_QUANT without one), unpacked into the kernel call
    options: dict  # the kernel keywords of a sliding window and a soft cap, when set


def _check_paged(op, query, key_cache, value_cache, block_table, block_size, q_seq_len, kv_seq_len, num_q_heads,
                 num_kv_heads, head_size_v, softmax_scale, alibi_slopes, attn_output, quant_bits, sliding_window,
                 logit_softcapping):
    """Checks what both paged attention ops take (the int8 cache's scales: `kv_quant.attention_args`);
    returns (the vendor's function (`kernel_for`), query as [T, Hq, D], Dv)."""
    query = AA.check_query(op, query)
    d = query.shape[2]
    hkv = AA.check_heads(op, query, num_q_heads, num_kv_heads)
    kernel, vendor = kernel_for(op, query.device)
    bits = kv_quant.check_quant_bits(op, vendor, quant_bits)
    check_dtype(vendor, op, query.dtype)
    check_head_dim(vendor, op, d)
    layout = active_kv_layout(query.device.type)
    dtypes = kv_quant.cache_dtypes(bits, query.dtype)
    _, bs = cache_dims(op, "key_cache", key_cache, layout, hkv, d, query.device, dtypes)
    dv = value_cache.shape[-1] if isinstance(value_cache, Tensor) and value_cache.dim() == 4 else d
    if head_size_v:
        dv = C.integer(op, "head_size_v", head_size_v, 1)
    cache_dims(op, "value_cache", value_cache, layout, hkv, dv, query.device, dtypes)
    if value_cache.dtype != key_cache.dtype:
        raise InvalidArgumentError(op, "value_cache", f"dtype {key_cache.dtype} like key_cache",
                                   C.describe(value_cache))
    if value_cache.shape[:3] != key_cache.shape[:3]:
        raise InvalidArgumentError(op, "value_cache", f"blocks like key_cache {list(key_cache.shape[:3])}",
                                   C.describe(value_cache))
    C.integer(op, "block_size", block_size, 1)
    if block_size != bs:
        raise InvalidArgumentError(op, "block_size", f"the caches' block size {bs}", str(block_size))
    C.tensor(op, "block_table", block_table, ("B", "M"), C.INDEX_DTYPES, query.device)
    b = block_table.shape[0]
    C.length_tensor(op, "q_seq_len", q_seq_len, b, query.device)
    C.length_tensor(op, "kv_seq_len", kv_seq_len, b, query.device)
    AA.check_scale(op, softmax_scale)
    AA.check_alibi(op, vendor, alibi_slopes, query)
    AA.check_score_options(op, vendor, sliding_window, logit_softcapping)
    if attn_output is not None:
        AA.check_output(op, query, dv, attn_output)
    return kernel, query, dv


def _paged_common(op, kernel, query, key_cache, value_cache, block_table, q_seq_len, kv_seq_len, num_kv_heads,
                  head_size_v, softmax_scale, alibi_slopes, attn_output, kv_scales, kv_zeros, quant_bits,
                  sliding_window, logit_softcapping) -> _Paged:
    """What both paged attention ops derive from arguments `_check_paged` passed."""
    query = token_rows(query)
    t, _, d = query.shape
    bits = 8 if quant_bits else 0
    layout = active_kv_layout(query.device.type)
    dv = value_cache.shape[-1]  # == head_size_v when that is set (checked)
    quant = kv_quant.attention_args(op, bits, kv_scales, kv_zeros, num_kv_heads, query.device)
    scale = AA.scale_value(softmax_scale, d)
    options = AA.option_kwargs(sliding_window, logit_softcapping)
    out = token_rows(attn_output) if attn_output is not None else query.new_empty((t, query.shape[1], dv))
    cu, kv = AA.paged_lengths(q_seq_len, kv_seq_len, query.device)
    check_values = C.check_values_enabled()
    if check_values and block_table.shape[0]:
        nb, bs = kv_layouts.blocks_and_size(key_cache, layout)
        AA.check_paged_values(op, cu, kv_seq_len, block_table, nb, bs, t)
    caches = (kv_quant.int8_view(key_cache), kv_quant.int8_view(value_cache))
    return _Paged(kernel, query, caches, layout, cu, kv, scale, alibi_slopes, out, check_values, quant, options)


def paged_prefill_attention(
    query: Tensor,
    key: Optional[Tensor],
    value: Optional[Tensor],
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    block_size: int,
    q_seq_len: Tensor,
    kv_seq_len: Tensor,
    max_q_seq_len: int,
    max_kv_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    attn_mask: Sequence = (),
    head_size_v: int = 0,
    softmax_scale: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    attn_output: Optional[Tensor] = None,
    kv_scales: Optional[Tensor] = None,
    kv_zeros: Optional[Tensor] = None,
    quant_bits: int = 0,
    sliding_window: Optional[int] = None,
    logit_softcapping: Optional[float] = None,
) -> Tensor:
    """New tokens attend to their sequence's history and to themselves through the paged cache.

    query: [T, Hq, D] new tokens of B sequences, packed.
    key, value: the new tokens' K/V ([T, Hkv, D] / [T, Hkv, Dv]); unused: they are already in the
        cache (fill_kv_cache ran first), LMDeploy passes them anyway.
    key_cache, value_cache: per-layer caches in the active layout (see fill_kv_cache); read only.
    block_table: [B, M] int32/int64 physical block ids per sequence; entries past a sequence's
        last block are ignored whatever they hold.
    block_size: BS of the caches.
    q_seq_len: [B] cumulative END offsets of the new tokens (cu_seqlens_q[1:]); CPU or device.
    kv_seq_len: [B] history + new tokens per sequence; CPU or device.
    max_q_seq_len, max_kv_seq_len: upper bounds of the per-sequence new and total lengths.
    num_q_heads, num_kv_heads: Hq, Hkv.  attn_mask: ignored (causal).
    head_size_v: Dv (0: the value cache's last dim).  softmax_scale: default D ** -0.5.
    alibi_slopes: [Hq] float32 or None.  attn_output: optional [T, Hq, Dv] output, WRITTEN.
    quant_bits: 0 (or None): caches in query's dtype; 8: int8 caches (uint8 read as int8), read back
        as (q - zero) * scale per KV head (dlinfer/ops/kv_quant.py); 4: UnsupportedError.
    kv_scales: [2] or [2, Hkv] float (K's then V's scale) when quant_bits=8, else None.
    kv_zeros: the zeros alike (None: 0) when quant_bits=8, else None.
    sliding_window, logit_softcapping: see the module docstring (None: off).
    Returns attn_output (or a new [T, Hq, Dv] tensor).
    """
    op = "paged_prefill_attention"
    args = (op, query, key, value, key_cache, value_cache, block_table, block_size, q_seq_len, kv_seq_len,
            max_q_seq_len, max_kv_seq_len, num_q_heads, num_kv_heads, head_size_v, softmax_scale, alibi_slopes,
            attn_output, quant_bits, sliding_window, logit_softcapping)
    kernel = (_check_paged_prefill(*args) if not torch.compiler.is_compiling()
              else checked(op, _check_paged_prefill, *args))
    p = _paged_common(op, kernel, query, key_cache, value_cache, block_table, q_seq_len, kv_seq_len, num_kv_heads,
                      head_size_v, softmax_scale, alibi_slopes, attn_output, kv_scales, kv_zeros, quant_bits,
                      sliding_window, logit_softcapping)
    max_q, max_kv = int_arg(max_q_seq_len), int_arg(max_kv_seq_len)
    if p.check_values and p.kv.numel():
        AA.check_bounds(op, p.cu, p.kv, max_q, max_kv)
    if p.query.shape[0] == 0:
        return p.out
    p.kernel(p.query, *p.caches, block_table, p.cu, p.kv, max_q, max_kv, p.scale, p.alibi, p.out, p.layout, *p.quant,
             **p.options)
    return p.out


def _check_paged_prefill(op, query, key, value, key_cache, value_cache, block_table, block_size, q_seq_len,
                         kv_seq_len, max_q_seq_len, max_kv_seq_len, num_q_heads, num_kv_heads, head_size_v,
                         softmax_scale, alibi_slopes, attn_output, quant_bits, sliding_window, logit_softcapping):
    kernel, query, dv = _check_paged(op, query, key_cache, value_cache, block_table, block_size, q_seq_len,
                                     kv_seq_len, num_q_heads, num_kv_heads, head_size_v, softmax_scale,
                                     alibi_slopes, attn_output, quant_bits, sliding_window, logit_softcapping)
    t, _, d = query.shape
    for name, new, dim in (("key", key, d), ("value", value, dv)):
        if new is not None:  # unused (already in the cache), but a wrong one means wrong metadata
            new = token_rows(new)
            C.tensor(op, name, new, (t, num_kv_heads, dim), C.FLOAT_DTYPES, query.device)
            C.same_dtype(op, name, new, query, "query")
    C.integer(op, "max_q_seq_len", max_q_seq_len, 0)
    C.integer(op, "max_kv_seq_len", max_kv_seq_len, 0)
    return kernel


def paged_decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    block_size: int,
    q_seq_len: Tensor,
    kv_seq_len: Tensor,
    max_kv_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size_v: int = 0,
    softmax_scale: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    attn_output: Optional[Tensor] = None,
    kv_scales: Optional[Tensor] = None,
    kv_zeros: Optional[Tensor] = None,
    quant_bits: int = 0,
    sliding_window: Optional[int] = None,
    logit_softcapping: Optional[float] = None,
) -> Tensor:
    """Decode: each sequence's newest token(s) attend to the paged cache.

    query: [T, Hq, D]; T = B for one token per sequence (q_seq_len = 1..B); several tokens per
        sequence (speculative decoding) follow the same cumulative-ends rule.
    Other arguments as in paged_prefill_attention (the new tokens' K/V are already in the cache).
    Returns attn_output (or a new [T, Hq, Dv] tensor).
    """
    op = "paged_decode_attention"
    args = (op, query, key_cache, value_cache, block_table, block_size, q_seq_len, kv_seq_len, max_kv_seq_len,
            num_q_heads, num_kv_heads, head_size_v, softmax_scale, alibi_slopes, attn_output, quant_bits,
            sliding_window, logit_softcapping)
    kernel = (_check_paged_decode(*args) if not torch.compiler.is_compiling()
              else checked(op, _check_paged_decode, *args))
    p = _paged_common(op, kernel, query, key_cache, value_cache, block_table, q_seq_len, kv_seq_len, num_kv_heads,
                      head_size_v, softmax_scale, alibi_slopes, attn_output, kv_scales, kv_zeros, quant_bits,
                      sliding_window, logit_softcapping)
    max_kv = int_arg(max_kv_seq_len)
    if p.check_values and p.kv.numel():
        AA.check_bounds(op, p.cu, p.kv, None, max_kv)
    if p.query.shape[0] == 0:
        return p.out
    p.kernel(p.query, *p.caches, block_table, p.cu, p.kv, max_kv, p.scale, p.alibi, p.out, p.layout, *p.quant,
             **p.options)
    return p.out


def _check_paged_decode(op, query, key_cache, value_cache, block_table, block_size, q_seq_len, kv_seq_len,
                        max_kv_seq_len, num_q_heads, num_kv_heads, head_size_v, softmax_scale, alibi_slopes,
                        attn_output, quant_bits, sliding_window, logit_softcapping):
    kernel, _, _ = _check_paged(op, query, key_cache, value_cache, block_table, block_size, q_seq_len, kv_seq_len,
                                num_q_heads, num_kv_heads, head_size_v, softmax_scale, alibi_slopes, attn_output,
                                quant_bits, sliding_window, logit_softcapping)
    C.integer(op, "max_kv_seq_len", max_kv_seq_len, 0)
    return kernel
