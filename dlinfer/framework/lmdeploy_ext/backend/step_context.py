"""Attention metadata for one engine step: what LMDeploy's dlinfer wrappers read.

LMDeploy builds a `StepContext` per forward (`StepContext.new` in model_inputs.py) and asks the ops backend to
attach `attn_metadata`. `backends/dlinfer/attention.py` and `kernels/dlinfer/pagedattention.py`
read from it (B sequences, T packed new tokens, M max blocks per sequence):

  block_offsets [B, M]       physical block ids per sequence (kernel blocks)
  q_seqlens [B], kv_seqlens [B]   new tokens / all tokens per sequence
  cu_seqlens_q [B+1]         cumulative new-token offsets; `cu_seqlens_q_cpu` the same on CPU
  kv_seqlens_cpu [B]         kv_seqlens on CPU
  kv_start_indices           cache slot (block * BS + offset) of each new token: [T] for
                             prefill (positions kv-q .. kv-1), [B] for one-token decode
  is_prefill_no_cache        no sequence has history: plain varlen prefill attention
  max_q_seqlen, max_kv_seq_len, kv_flatten_size (sum of kv_seqlens), block_size (BS)
  attention_mask             unused by dlinfer's vendors: ()
  quant_policy, quant_meta   0 and None, or 8 and the int8 KV cache's per-layer scales (`kv_int8.py`)

The model in Ascend's `update_step_context` (backends/dlinfer/ascend/op_backend.py) builds the
prefill slots with a Python loop per sequence; here every field is a few vectorised tensor ops
and no device sync (the "no history" test compares host integers LMDeploy already has).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lmdeploy.pytorch.backends.dlinfer.attention import DlinferAttentionMetadata
from lmdeploy.pytorch.distributed import get_tp_world_rank

from dlinfer.framework.lmdeploy_ext.backend.kv_int8 import quant_meta_of
from dlinfer.utils.type_annotation import MoeMetadata


def new_token_slots(q_seqlens: torch.Tensor, kv_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    block_offsets: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Cache slot of every new token: [T] (int64).

    Token i of sequence b (0 <= i < q_b) sits at position p = kv_b - q_b + i, in slot
    block_offsets[b, p // BS] * BS + p % BS.
    """
    batch = q_seqlens.numel()
    seq = torch.repeat_interleave(torch.arange(batch, device=q_seqlens.device), q_seqlens, output_size=num_tokens)
    token = torch.arange(num_tokens, device=q_seqlens.device)
    pos = token - cu_seqlens_q[seq] + (kv_seqlens - q_seqlens)[seq]
    blocks = block_offsets[seq, torch.div(pos, block_size, rounding_mode="floor")].long()
    return blocks * block_size + pos.remainder(block_size)


def last_token_slots(kv_seqlens: torch.Tensor, block_offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each sequence's last position (the one new token when decoding): [B] (int64)."""
    pos = (kv_seqlens - 1).long()
    blocks = block_offsets.gather(1, torch.div(pos, block_size, rounding_mode="floor")[:, None])[:, 0].long()
    return blocks * block_size + pos.remainder(block_size)


def build_attention_metadata(step_context, block_size: int) -> DlinferAttentionMetadata:
    """The DlinferAttentionMetadata of `step_context` for caches of block size `block_size`."""
    q_seqlens = step_context.q_seqlens
    kv_seqlens = step_context.kv_seqlens
    block_offsets = step_context.block_offsets
    num_tokens = step_context.input_ids.numel()
    is_decoding = step_context.is_decoding
    if is_decoding and step_context.max_q_seqlen != 1:
        raise NotImplementedError("dlinfer device types decode one token per sequence per step "
                                  f"(got max_q_seqlen={step_context.max_q_seqlen}).")

    cu_seqlens_q = F.pad(torch.cumsum(q_seqlens, dim=0), (1, 0))
    on_cpu = q_seqlens.device.type == "cpu"
    cu_seqlens_q_cpu = cu_seqlens_q if on_cpu else cu_seqlens_q.cpu()
    kv_seqlens_cpu = kv_seqlens if on_cpu else kv_seqlens.cpu()

    if is_decoding:
        kv_start_indices = last_token_slots(kv_seqlens, block_offsets, block_size)
        is_prefill_no_cache = False
    else:
        kv_start_indices = new_token_slots(q_seqlens, kv_seqlens, cu_seqlens_q, block_offsets, block_size,
                                           num_tokens)
        # kv_b >= q_b for every b, so the sums are equal exactly when no sequence has history.
        is_prefill_no_cache = step_context.sum_kv_seqlen == num_tokens

    return DlinferAttentionMetadata(
        is_decoding,
        block_offsets,
        q_start_loc=cu_seqlens_q[:-1],
        q_seqlens=q_seqlens,
        kv_seqlens=kv_seqlens,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_q_cpu=cu_seqlens_q_cpu,
        kv_seqlens_cpu=kv_seqlens_cpu,
        kv_start_indices=kv_start_indices,
        block_size=block_size,
        attention_mask=(),
        is_prefill_no_cache=is_prefill_no_cache,
        max_q_seqlen=step_context.max_q_seqlen,
        max_kv_seq_len=step_context.max_kv_seqlen,
        kv_flatten_size=step_context.sum_kv_seqlen,
        quant_policy=step_context.kv_quant_policy,
        quant_meta=quant_meta_of(step_context),
    )


def build_moe_metadata() -> MoeMetadata:
    """The MoE context of one step on a dlinfer device type: no expert or data parallelism
    (refused when the engine is built), tensor parallelism as LMDeploy's MoE layers split it.

    LMDeploy's plain fused-MoE layer takes None here, but its W8A8 one (backends/dlinfer/moe.py,
    DlinferFusedMoEW8A8Impl) raises without it; the layers write `expert_ids_per_ep_rank` and
    `router_n_groups` into it, which dlinfer.ops checks (a grouped router is refused by name).
    """
    tp_size, tp_rank = get_tp_world_rank("moe")
    return MoeMetadata(tp_size=tp_size, tp_rank=tp_rank)
