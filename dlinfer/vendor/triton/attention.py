"""The triton vendor's attention ops, with the canonical signatures of dlinfer/vendor/op_table.py.

Arguments arrive validated and normalised by dlinfer.ops: cu_seqlens_q [B+1] and kv_seq_len [B]
int32 on the query's device, block_table [B, M] int32/int64, max_* upper bounds, out [T, Hq, Dv]
possibly a strided view (query[..., :Dv]), kv_layout "token_major" [NB, BS, Hkv, D] or
"head_major" [NB, Hkv, BS, D]. Any head dims (padded to a power of two and masked), any GQA ratio,
fp32/fp16/bf16 with fp32 accumulation. No op reads a value on the host (CUDA-graph safe).

  prefill_attention        -> attention_prefill.py (varlen causal flash attention, packed K/V)
  paged_prefill_attention  -> attention_prefill.py (the same kernel, keys gathered from the cache)
  paged_decode_attention   -> attention_decode.py  (split-KV flash-decoding + log-sum-exp reduce)
"""

from __future__ import annotations

from dlinfer.vendor.triton.attention_decode import num_kv_splits, paged_decode
from dlinfer.vendor.triton.attention_prefill import paged_prefill, prefill

__all__ = ["prefill_attention", "paged_prefill_attention", "paged_decode_attention", "num_kv_splits"]


def prefill_attention(query, key, value, cu_seqlens_q, max_q_seq_len, softmax_scale, alibi_slopes, out,
                      sliding_window=0, logit_softcapping=0.0) -> None:
    """query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv], cu_seqlens_q [B+1] -> out [T, Hq, Dv]."""
    prefill(query, key, value, cu_seqlens_q, max_q_seq_len, softmax_scale, alibi_slopes, out, sliding_window,
            logit_softcapping)


def paged_prefill_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_q_seq_len,
                            max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout, k_scale=None, k_zero=None,
                            v_scale=None, v_zero=None, sliding_window=0, logit_softcapping=0.0) -> None:
    """New tokens [T, Hq, D] over their sequences' paged history and themselves -> out [T, Hq, Dv]."""
    paged_prefill(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_q_seq_len,
                  max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout, (k_scale, k_zero, v_scale, v_zero),
                  sliding_window, logit_softcapping)


def paged_decode_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len,
                           softmax_scale, alibi_slopes, out, kv_layout, k_scale=None, k_zero=None, v_scale=None,
                           v_zero=None, sliding_window=0, logit_softcapping=0.0) -> None:
    """Each sequence's newest token(s) [T, Hq, D] over the paged cache -> out [T, Hq, Dv]."""
    paged_decode(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len,
                 softmax_scale, alibi_slopes, out, kv_layout, (k_scale, k_zero, v_scale, v_zero),
                 window=sliding_window, softcap=logit_softcapping)
