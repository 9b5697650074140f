"""LMDeploy's AWQ "gemm" layout (AutoAWQ's GEMM format), as its loader reads it
(lmdeploy/pytorch/nn/linear/awq.py: qweight int32 [K, N/8], qzeros int32 [K/g, N/8],
scales [K/g, N]): output column c = 8*j + ORDER[i] sits in bits 4i..4i+3 of int32 j."""

from __future__ import annotations

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_columns(values):
    """`values [R, N]` integers 0..15 -> int32 `[R, N/8]` in the AWQ nibble order."""
    import torch

    r, n = values.shape
    v = values.to(torch.int64).reshape(r, n // 8, 8)
    packed = torch.zeros(r, n // 8, dtype=torch.int64)
    for i, col in enumerate(ORDER):
        packed |= v[:, :, col] << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # the same 32 bits, as signed int32
    return packed.to(torch.int32)


def awq_tensors(weight, group_size: int, scale_dtype):
    """{qweight, qzeros, scales} of a float `weight [N, K]` (torch.nn.Linear's layout)."""
    from dlinfer.quantize.awq import quant_params

    q, zero, scale = quant_params(weight, group_size, scale_dtype)
    return {
        "qweight": pack_columns(q.T.contiguous()),          # [K, N/8]
        "qzeros": pack_columns(zero.T.contiguous()),        # [K/g, N/8]
        "scales": scale.T.contiguous().to(scale_dtype),     # [K/g, N]
    }
