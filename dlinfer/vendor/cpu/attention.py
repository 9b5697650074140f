"""paged_decode_attention through the C++ kernel (csrc/attention.cpp)."""

import torch
from torch import Tensor

from dlinfer.vendor.base import HEAD_MAJOR

_decode = torch.ops.dlinfer_cpu.paged_decode_attention.default


def paged_decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                           cu_seqlens_q: Tensor, kv_seq_len: Tensor, max_kv_seq_len: int, softmax_scale: float,
                           alibi_slopes, out: Tensor, kv_layout: str) -> None:
    """query [T, Hq, D], caches in `kv_layout`, block_table [B, M], cu_seqlens_q [B+1],
    kv_seq_len [B] -> out [T, Hq, Dv] (written in place)."""
    _decode(query, key_cache, value_cache, block_table.contiguous(), cu_seqlens_q.contiguous(),
            kv_seq_len.contiguous(), max_kv_seq_len, softmax_scale,
            None if alibi_slopes is None else alibi_slopes.contiguous(), out, kv_layout == HEAD_MAJOR)
