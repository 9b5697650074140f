"""The ops as torch custom ops (`torch.ops.dlinfer.<name>`), with their canonical arguments.

These canonical signatures are also what a vendor implements (its op table): the public functions
in `dlinfer.ops` validate and normalise LMDeploy-style arguments into them. Under torch.compile the
public ops call these custom ops, so Dynamo records each as a single graph node; in eager mode the
public ops call the vendor function directly (no dispatcher cost).

Canonical arguments (T tokens, B sequences, Hq/Hkv heads, D/Dv head dims, NB blocks, BS block size):
  rms_norm(hidden_states [N, H], weight [H], epsilon) -> [N, H]
  add_rms_norm(hidden_states [N, H], residual [N, H], weight [H], epsilon) -> ([N, H], [N, H])
  apply_rotary_pos_emb(query [T, Hq, D], key [T, Hkv, D], cos [T, R], sin [T, R]) -> (q, k)
  fill_kv_cache(key [T, Hkv, D], value [T, Hkv, Dv], key_cache!, value_cache!, kv_indices [T],
                kv_layout) -> None
  prefill_attention(query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv], cu_seqlens_q [B+1],
                    max_q_seq_len, softmax_scale, alibi_slopes [Hq]?, out! [T, Hq, Dv]) -> None
  paged_prefill_attention(query, key_cache, value_cache, block_table [B, M], cu_seqlens_q [B+1],
                          kv_seq_len [B], max_q_seq_len, max_kv_seq_len, softmax_scale,
                          alibi_slopes?, out!, kv_layout) -> None
  paged_decode_attention(query, key_cache, value_cache, block_table, cu_seqlens_q [B+1],
                         kv_seq_len [B], max_kv_seq_len, softmax_scale, alibi_slopes?, out!,
                         kv_layout) -> None
  moe_gating_topk_softmax(router_logits [T, E], topk) -> (weights [T, K] f32, ids [T, K] i64)
  fused_moe(hidden_states [T, H], gate_up_weights [E, 2I, H], down_weights [E, H, I],
            topk_weights [T, K], topk_ids [T, K], renormalize) -> [T, H]
  silu_and_mul(x [N, 2I]) -> [N, I]
  linear(x [N, K], weight [Nout, K], bias [Nout]?) -> [N, Nout]
("!" marks arguments written in place.) cu_seqlens_q and kv_seq_len are int32 on the query's
device; max_* are upper bounds (grids may be sized by them); kv_layout is "token_major" or
"head_major". Index tensors (kv_indices, block_table) are int32 or int64 as the caller gave them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from dlinfer.vendor.selection import resolve

_LIB = "dlinfer"


def _impl(op: str, device: torch.device):
    return resolve(op, device.type)[0]


@torch.library.custom_op(f"{_LIB}::rms_norm", mutates_args=())
def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    return _impl("rms_norm", hidden_states.device)(hidden_states, weight, epsilon)


@rms_norm.register_fake
def _(hidden_states, weight, epsilon):
    return torch.empty_like(hidden_states)


@torch.library.custom_op(f"{_LIB}::add_rms_norm", mutates_args=())
def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> Tuple[Tensor, Tensor]:
    return _impl("add_rms_norm", hidden_states.device)(hidden_states, residual, weight, epsilon)


@add_rms_norm.register_fake
def _(hidden_states, residual, weight, epsilon):
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states)


@torch.library.custom_op(f"{_LIB}::apply_rotary_pos_emb", mutates_args=())
def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    return _impl("apply_rotary_pos_emb", query.device)(query, key, cos, sin)


@apply_rotary_pos_emb.register_fake
def _(query, key, cos, sin):
    return torch.empty_like(query), torch.empty_like(key)


@torch.library.custom_op(f"{_LIB}::fill_kv_cache", mutates_args=("key_cache", "value_cache"))
def fill_kv_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, kv_indices: Tensor, kv_layout: str
) -> None:
    _impl("fill_kv_cache", key.device)(key, value, key_cache, value_cache, kv_indices, kv_layout)


@fill_kv_cache.register_fake
def _(key, value, key_cache, value_cache, kv_indices, kv_layout):
    return None


@torch.library.custom_op(f"{_LIB}::prefill_attention", mutates_args=("out",))
def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    max_q_seq_len: int,
    softmax_scale: float,
    alibi_slopes: Optional[Tensor],
    out: Tensor,
) -> None:
    _impl("prefill_attention", query.device)(
        query, key, value, cu_seqlens_q, max_q_seq_len, softmax_scale, alibi_slopes, out
    )


@prefill_attention.register_fake
def _(query, key, value, cu_seqlens_q, max_q_seq_len, softmax_scale, alibi_slopes, out):
    return None


@torch.library.custom_op(f"{_LIB}::paged_prefill_attention", mutates_args=("out",))
def paged_prefill_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    kv_seq_len: Tensor,
    max_q_seq_len: int,
    max_kv_seq_len: int,
    softmax_scale: float,
    alibi_slopes: Optional[Tensor],
    out: Tensor,
    kv_layout: str,
) -> None:
    _impl("paged_prefill_attention", query.device)(
        query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len,
        max_q_seq_len, max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout,
    )


@paged_prefill_attention.register_fake
def _(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_q_seq_len, max_kv_seq_len,
      softmax_scale, alibi_slopes, out, kv_layout):
    return None


@torch.library.custom_op(f"{_LIB}::paged_decode_attention", mutates_args=("out",))
def paged_decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    kv_seq_len: Tensor,
    max_kv_seq_len: int,
    softmax_scale: float,
    alibi_slopes: Optional[Tensor],
    out: Tensor,
    kv_layout: str,
) -> None:
    _impl("paged_decode_attention", query.device)(
        query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len,
        max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout,
    )


@paged_decode_attention.register_fake
def _(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len, softmax_scale,
      alibi_slopes, out, kv_layout):
    return None


@torch.library.custom_op(f"{_LIB}::moe_gating_topk_softmax", mutates_args=())
def moe_gating_topk_softmax(router_logits: Tensor, topk: int) -> Tuple[Tensor, Tensor]:
    return _impl("moe_gating_topk_softmax", router_logits.device)(router_logits, topk)


@moe_gating_topk_softmax.register_fake
def _(router_logits, topk):
    shape = (router_logits.shape[0], topk)
    return (router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int64))


@torch.library.custom_op(f"{_LIB}::fused_moe", mutates_args=())
def fused_moe(
    hidden_states: Tensor,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    renormalize: bool,
) -> Tensor:
    return _impl("fused_moe", hidden_states.device)(
        hidden_states, gate_up_weights, down_weights, topk_weights, topk_ids, renormalize
    )


@fused_moe.register_fake
def _(hidden_states, gate_up_weights, down_weights, topk_weights, topk_ids, renormalize):
    return torch.empty_like(hidden_states)


@torch.library.custom_op(f"{_LIB}::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    return _impl("silu_and_mul", x.device)(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(f"{_LIB}::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return _impl("linear", x.device)(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
