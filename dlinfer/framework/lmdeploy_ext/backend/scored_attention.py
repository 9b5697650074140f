"""LMDeploy's dlinfer attention layer with a sliding window or logit soft-capping.

Why: LMDeploy 0.18.0's dlinfer layer (`backends/dlinfer/attention.py`, `DlinferAttentionImpl`)
takes `sliding_window` and `logit_softcapping` from the model (Mistral, Qwen2 with
use_sliding_window, Phi-3, Gemma 2/3 per layer) and drops both: its kernel wrapper
(`kernels/dlinfer/pagedattention.py`) has no such arguments, so every such model would attend to
its whole history without a cap, and answer differently from transformers as soon as a prompt is
longer than the window.

How: the same layer, whose `paged_attention_fwd` (the one function it calls after filling the
cache) is `scored_paged_attention_fwd` bound to the layer's window and cap: the kernel wrapper's
dispatch (prefill without history, paged prefill, decode) with dlinfer's ops called with
`sliding_window=` and `logit_softcapping=` (docs/design.md, "Sliding windows and soft-capping").
Layers with neither keep LMDeploy's own layer. The window is LMDeploy's int, transformers' count
of keys (the token itself included); -1 or None is a global layer. Written against LMDeploy
0.18.0.
"""

from __future__ import annotations

import functools
from typing import Optional

from lmdeploy.pytorch.backends.attention import PagedAttentionBuildSpec
from lmdeploy.pytorch.backends.dlinfer.attention import DlinferAttentionImpl

import dlinfer.ops


def window_of(sliding_window) -> Optional[int]:
    """LMDeploy's `sliding_window` as dlinfer's op argument: an int >= 1, or None for none (-1,
    None, 0). A (left, right) pair, which no LMDeploy 0.18 model passes, is refused by name."""
    if sliding_window is None or isinstance(sliding_window, bool):
        return None
    if isinstance(sliding_window, int):
        return sliding_window if sliding_window > 0 else None
    raise ValueError(f"dlinfer's attention takes a sliding window as one int (transformers' count of keys); "
                     f"got {sliding_window!r}")


def softcap_of(logit_softcapping) -> Optional[float]:
    return float(logit_softcapping) if logit_softcapping else None


def scored_paged_attention_fwd(query_states, key_states, value_states, attn_output, key_cache, value_cache,
                               block_offsets, q_seqlens, kv_seqlens, max_q_seq_len, max_kv_seq_len, is_decoding,
                               block_size, num_heads, num_kv_heads, v_head_size, cu_seqlens_q, cu_seqlens_q_cpu,
                               kv_seqlens_cpu, attn_mask=(), softmax_scale=None, is_prefill_no_cache=None,
                               kv_scales=None, kv_zeros=None, quant_bits=0, *, sliding_window=None,
                               logit_softcapping=None):
    """`lmdeploy.pytorch.kernels.dlinfer.paged_attention_fwd` (same arguments, same dispatch)
    with the layer's window and cap passed to each op."""
    options = dict(sliding_window=sliding_window, logit_softcapping=logit_softcapping)
    ends_cpu = cu_seqlens_q_cpu[1:]
    if is_decoding:
        return dlinfer.ops.paged_decode_attention(
            query_states, key_cache, value_cache, block_offsets, block_size, ends_cpu, kv_seqlens_cpu,
            max_kv_seq_len, num_heads, num_kv_heads, head_size_v=v_head_size, softmax_scale=softmax_scale,
            attn_output=attn_output, kv_scales=kv_scales, kv_zeros=kv_zeros, quant_bits=quant_bits, **options)
    if is_prefill_no_cache:
        return dlinfer.ops.prefill_attention(
            query_states, key_states, value_states, key_cache, value_cache, q_seqlens, kv_seqlens, max_q_seq_len,
            num_heads, num_kv_heads, attn_mask, softmax_scale=softmax_scale, attn_output=attn_output,
            actual_seq_lengths_cpu=ends_cpu, **options)
    return dlinfer.ops.paged_prefill_attention(
        query_states, key_states, value_states, key_cache, value_cache, block_offsets, block_size, ends_cpu,
        kv_seqlens_cpu, max_q_seq_len, max_kv_seq_len, num_heads, num_kv_heads, attn_mask, head_size_v=v_head_size,
        softmax_scale=softmax_scale, attn_output=attn_output, kv_scales=kv_scales, kv_zeros=kv_zeros,
        quant_bits=quant_bits, **options)


def build_scored_attention(spec: PagedAttentionBuildSpec) -> Optional[DlinferAttentionImpl]:
    """LMDeploy's dlinfer attention layer for `spec` calling the ops with its window and cap;
    None when it has neither (LMDeploy's own layer then serves it)."""
    window, cap = window_of(spec.sliding_window), softcap_of(spec.logit_softcapping)
    if window is None and cap is None:
        return None
    impl = DlinferAttentionImpl(num_heads=spec.num_heads, head_size=spec.head_dim, scale=spec.scale,
                                num_kv_heads=spec.num_kv_heads, v_head_size=spec.v_head_dim, alibi=spec.alibi,
                                sliding_window=spec.sliding_window, logit_softcapping=spec.logit_softcapping,
                                causal=spec.causal, use_flash_mla=spec.use_flash_mla)
    impl.paged_attention_fwd = functools.partial(scored_paged_attention_fwd, sliding_window=window,
                                                 logit_softcapping=cap)
    return impl
