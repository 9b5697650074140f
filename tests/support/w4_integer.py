"""What the tests of the cpu vendor's integer-activation W4 paths (4 and 5 of
w4_matmul_k_interleaved) share: the weight as exact integers and float64 scales, and one call
through the hook, the eager op and the graph binding."""

import torch

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.conformance.reference import awq_unpack


def dequantised(qweight, scale, offset, group):
    """(q - z) int64 [K, N] and s float64 [K/g, N] (z = 8 without offset)."""
    q = awq_unpack(qweight).to(torch.int64)
    z = awq_unpack(offset).to(torch.int64) if offset is not None else torch.full_like(q[:1], 8)
    z = z.repeat_interleave(group, 0) if offset is not None else z
    return q - z, scale.double()


def eager_and_bound(x, qweight, scale, offset, group):
    """Repacks the weight through the cpu vendor's hook under the current settings, then multiplies
    x by it through the eager op and through the graph binding: (packed, s, o, eager, bound), bound
    None where the binding leaves the call site to the op function."""
    from dlinfer.vendor.cpu import graph_bindings

    with dlinfer.vendor.using("cpu"):
        packed, s, o = ops.repack_weight_quant(qweight, scale, offset, group)
        eager = ops.weight_quant_matmul(x, packed, s, o, None, False, group)
    bound = graph_bindings.weight_quant_matmul(x, packed, s, o, None, group)
    return packed, s, o, eager, None if bound is None else bound(x, packed, s, o, None, group)
