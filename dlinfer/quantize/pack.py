"""LMDeploy's AWQ "gemm" layout (AutoAWQ's GEMM format), as its loader reads it
(lmdeploy/pytorch/nn/linear/awq.py: qweight int32 [K, N/8], qzeros int32 [K/g, N/8],
scales [K/g, N]). The nibble packing itself is dlinfer/vendor/w4_layouts.py's `pack`, the one
place that knows the layout."""

from __future__ import annotations


def awq_tensors(weight, group_size: int, scale_dtype):
    """{qweight, qzeros, scales} of a float `weight [N, K]` (torch.nn.Linear's layout)."""
    from dlinfer.quantize.awq import quant_params

    return awq_packed(*quant_params(weight, group_size, scale_dtype), scale_dtype)


def awq_packed(q, zero, scale, scale_dtype):
    """{qweight, qzeros, scales} of `awq.quant_params`' (q [N, K], zero [N, K/g], scale [N, K/g])."""
    from dlinfer.vendor.w4_layouts import pack

    return {
        "qweight": pack(q.T.contiguous()),          # [K, N/8]
        "qzeros": pack(zero.T.contiguous()),        # [K/g, N/8]
        "scales": scale.T.contiguous().to(scale_dtype),     # [K/g, N]
    }
