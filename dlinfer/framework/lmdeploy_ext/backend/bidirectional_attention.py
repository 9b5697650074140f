"""Non-causal attention without a KV cache (vision towers) on dlinfer's ops.

Why: LMDeploy 0.18.0's vision towers (Qwen2-VL, Qwen2.5-VL: `VisionAttention.__init__` in
models/qwen2_vl.py, `Qwen2_5_VLVisionAttention.__init__` in models/qwen2_5_vl.py) build
`nn.FlashAttention(..., causal=False)`: every patch of an image
(or of a Qwen2.5-VL window) attends to every other. LMDeploy's dlinfer layer
(`backends/dlinfer/flash_attention.py`) stores `causal` but its kernel wrapper
(`kernels/dlinfer/flash_attention.py`) calls `dlinfer.ops.prefill_attention`, which is causal, and
drops the flag: each patch would see only the patches before it, and a Qwen2-VL ran that way
generated other tokens than HF transformers from the first one on (tests/lmdeploy/test_vlm.py
found it).

How: dlinfer has no bidirectional attention op, but its paged decode attention is one: a query
that is the only new token of its sequence attends to every cached position of that sequence,
none masked. So each segment's keys and values are written by `dlinfer.ops.fill_kv_cache` to a
scratch paged cache (blocks of `BLOCK_SIZE` tokens, in the active vendor's layout), and
`dlinfer.ops.paged_decode_attention` runs every query row as a one-token sequence whose block
table is its segment's blocks and whose length is the segment's key count. The result is the
softmax over exactly the segment's keys, as HF's `cu_seqlens` attention computes it. The scratch
cache lives for one call (one vision layer), about the size of that layer's K and V.

The ops backend (`op_backend.DlinferDeviceOpsBackend.build_op`) builds this layer for every
`FlashAttentionBuildSpec` with `causal=False` on dlinfer's device types; causal specs keep
LMDeploy's dlinfer layer. LMDeploy's own device types (ascend, maca, camb) are untouched.
Written against LMDeploy 0.18.0.
"""

from __future__ import annotations

import torch
from lmdeploy.pytorch.backends.flash_attention import FlashAttentionBuildSpec, FlashAttentionImpl
from torch import Tensor

import dlinfer.ops
from dlinfer.framework.lmdeploy_ext.backend.kv_layout import active_kv_layout, block_shape

# Tokens per block of the scratch cache. Any size gives the same result; larger blocks mean fewer
# block-table entries per query row (the table is [query rows, blocks of the longest segment]).
BLOCK_SIZE = 64


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """cat(arange(s, s + n) for s, n in zip(starts, lengths)), int64."""
    total = int(lengths.sum())
    begins = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - begins, lengths, output_size=total) + torch.arange(total)


class DlinferBidirectionalAttentionImpl(FlashAttentionImpl):
    """Varlen attention in which each query row sees every key of its segment (no causal mask)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float | None = None, num_kv_heads: int | None = None,
                 v_head_dim: int | None = None):
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim

    def forward(self, query: Tensor, key: Tensor, value: Tensor, q_start_loc: Tensor, q_seqlens: Tensor,
                kv_start_loc: Tensor, kv_seqlens: Tensor, max_q_seqlen: int | None = None) -> Tensor:
        """query [T, Hq, D], key [Tk, Hkv, D], value [Tk, Hkv, Dv]; segment b's query rows
        q_start_loc[b] + [0, q_seqlens[b]) attend to its key rows kv_start_loc[b] + [0, kv_seqlens[b]).
        Returns [T, Hq, Dv]; rows no segment covers, or whose segment has no key, are zero."""
        out = query.new_zeros(query.shape[:-1] + (self.v_head_dim,))
        qs, qn, ks, kn = (t.to("cpu", torch.int64).view(-1) for t in (q_start_loc, q_seqlens, kv_start_loc, kv_seqlens))
        keep = (qn > 0) & (kn > 0)
        qs, qn, ks, kn = qs[keep], qn[keep], ks[keep], kn[keep]
        if qs.numel() == 0:
            return out
        blocks = (kn + BLOCK_SIZE - 1) // BLOCK_SIZE
        first_block = torch.cumsum(blocks, 0) - blocks
        num_blocks = int(blocks.sum())

        # The segments' keys and values in a scratch paged cache, segment b from block first_block[b].
        device = query.device
        layout = active_kv_layout(device.type)
        k_cache = key.new_zeros((num_blocks, *block_shape(layout, BLOCK_SIZE, self.num_kv_heads, self.head_dim)))
        v_cache = value.new_zeros((num_blocks, *block_shape(layout, BLOCK_SIZE, self.num_kv_heads, self.v_head_dim)))
        key_rows = _ranges(ks, kn)
        slots = _ranges(first_block * BLOCK_SIZE, kn)
        dlinfer.ops.fill_kv_cache(key[key_rows.to(device)], value[key_rows.to(device)], k_cache, v_cache,
                                  slots.to(device))

        # Every query row a one-token sequence over its segment's blocks.
        segment = torch.repeat_interleave(torch.arange(qs.numel()), qn)
        tables = first_block[:, None] + torch.arange(int(blocks.max()))[None, :]
        block_table = torch.minimum(tables, torch.tensor(num_blocks - 1))[segment]
        rows = _ranges(qs, qn).to(device)
        attn = dlinfer.ops.paged_decode_attention(
            query[rows], k_cache, v_cache, block_table.to(device, torch.int32), BLOCK_SIZE,
            torch.arange(1, rows.numel() + 1, dtype=torch.int32).to(device), kn[segment].to(device, torch.int32),
            int(kn.max()), self.num_heads, self.num_kv_heads, head_size_v=self.v_head_dim,
            softmax_scale=self.scale)
        out[rows] = attn
        return out


def build_bidirectional_attention(spec: FlashAttentionBuildSpec) -> DlinferBidirectionalAttentionImpl | None:
    """The layer for a non-causal `spec`; None for a causal one (LMDeploy's dlinfer layer runs it)."""
    if spec.causal:
        return None
    if spec.sliding_window not in (None, -1, (-1, -1)) or spec.logit_softcapping:
        raise NotImplementedError(
            "dlinfer's device types run non-causal attention without sliding windows or logit soft-capping "
            f"(got sliding_window={spec.sliding_window!r}, logit_softcapping={spec.logit_softcapping!r}).")
    return DlinferBidirectionalAttentionImpl(spec.num_heads, spec.head_dim, spec.scale, spec.num_kv_heads,
                                             spec.v_head_dim)
