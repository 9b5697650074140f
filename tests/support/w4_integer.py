"""What the tests of the cpu vendor's integer-activation W4 paths (4 and 5 of
w4_matmul_k_interleaved) share: the weight as exact integers and float64 scales."""

import torch

from dlinfer.conformance.reference import awq_unpack


def dequantised(qweight, scale, offset, group):
    """(q - z) int64 [K, N] and s float64 [K/g, N] (z = 8 without offset)."""
    q = awq_unpack(qweight).to(torch.int64)
    z = awq_unpack(offset).to(torch.int64) if offset is not None else torch.full_like(q[:1], 8)
    z = z.repeat_interleave(group, 0) if offset is not None else z
    return q - z, scale.double()
