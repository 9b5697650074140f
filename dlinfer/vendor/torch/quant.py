"""W8A8 in PyTorch: int8 symmetric, per-token activation scales, per-output-channel weight scales.

The int8 x int8 product is computed as a float64 matmul and converted to int32: every product of
two int8 values and every partial sum is an integer of magnitude <= K * 128**2, exactly
representable in float64 (53 bits) for K < 2**39, so the result is exact in any summation order
(BLAS, cuBLAS) and equals an int32 accumulation wherever that does not overflow (K * 2**14 < 2**31,
i.e. K <= 131071). One path on every device (torch has no integer matmul on CUDA other than
torch._int_mm, which constrains the shapes).
"""

import torch
from torch import Tensor

from dlinfer.vendor.torch.moe import expert_order
from dlinfer.vendor.torch.norm import add_rms_norm, rms_norm


def dynamic_quant(x: Tensor):
    """x [N, K] float -> (xq [N, K] int8, scale [N] float32).

    scale = amax(|x|) / 127 in float32; xq = clamp(round_half_even(x / scale), -128, 127) with
    the division in float32. A zero row gets scale 0 and xq 0 (divided by 1, never 0/0).
    Both divisions are tensor by tensor on x's device, so both are correctly rounded: PyTorch's
    CUDA division by a Python scalar multiplies by its reciprocal instead (BinaryDivTrueKernel),
    which is one ulp off for some amax and made the codes differ from the triton vendor's on an
    H200 (docs/gpu.md).
    """
    xf = x.float()
    if xf.shape[-1]:
        scale = xf.abs().amax(dim=-1) / torch.full((), 127.0, dtype=torch.float32, device=xf.device)
    else:
        scale = xf.new_zeros(xf.shape[:-1])
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    xq = torch.round(xf / divisor.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8)
    return xq, scale


def int8_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a [N, K] int8 @ b [Nout, K] int8 .T -> [N, Nout] int32, exact (see the module docstring)."""
    return (a.double() @ b.double().T).to(torch.int32)


def linear_w8a8(a: Tensor, b: Tensor, rms_scale: Tensor, linear_scale: Tensor, out_dtype: torch.dtype, bias=None):
    """(a @ b.T as int32) * rms_scale[:, None] * linear_scale (+ bias), in float32, cast to out_dtype.
    linear_scale: [N] or [N, 1]."""
    acc = int8_matmul(a, b).float()
    out = acc * rms_scale.unsqueeze(-1) * linear_scale.reshape(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def rms_norm_w8a8(hidden_states: Tensor, weight: Tensor, epsilon: float):
    """dynamic_quant(rms_norm(h, w, eps)): the norm rounded to h's dtype, then quantised."""
    return dynamic_quant(rms_norm(hidden_states, weight, epsilon))


def add_rms_norm_w8a8(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float):
    """(xq, scale, h + r) of rms_norm_w8a8(h + r); the sum in the activation dtype."""
    normed, added = add_rms_norm(hidden_states, residual, weight, epsilon)
    xq, scale = dynamic_quant(normed)
    return xq, scale, added


def fused_moe_w8a8(hidden_states: Tensor, gate_up_weights: Tensor, gate_up_scales: Tensor, down_weights: Tensor,
                   down_scales: Tensor, topk_weights: Tensor, topk_ids: Tensor, renormalize: bool) -> Tensor:
    """hidden [T, H], gate_up int8 [E, 2I, H] with scales f32 [E, 2I], down int8 [E, H, I] with scales
    f32 [E, H], weights / ids [T, K] -> [T, H] in hidden's dtype.

    x is quantised once per token; the (token, expert) pairs are sorted by expert and each active
    expert runs: gate_up = int8 GEMM * x_scale * gate_up_scale (float32), act = silu(gate) * up
    (float32), per-token quantisation of act, int8 GEMM * act_scale * down_scale; the K results
    of a token are combined in float32 with its (renormalised) weights.
    """
    t, k = topk_ids.shape
    num_experts, two_i, _ = gate_up_weights.shape
    inter = two_i // 2
    weights = topk_weights.float()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    xq, x_scale = dynamic_quant(hidden_states)
    flat_ids = topk_ids.reshape(-1).long()
    order, counts = expert_order(flat_ids, num_experts)
    flat_weights = weights.reshape(-1)
    # float32 (float64 when the op tools rerun the call in float64, scales included)
    acc_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    out = torch.zeros(t, hidden_states.shape[1], dtype=acc_dtype, device=hidden_states.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // k
        gate_up = int8_matmul(xq[tokens], gate_up_weights[expert]).float()
        gate_up = gate_up * x_scale[tokens].unsqueeze(-1) * gate_up_scales[expert]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        aq, a_scale = dynamic_quant(act)
        y = int8_matmul(aq, down_weights[expert]).float() * a_scale.unsqueeze(-1) * down_scales[expert]
        out.index_add_(0, tokens, (y * flat_weights[pairs].unsqueeze(1)).to(acc_dtype))
    return out.to(hidden_states.dtype)


def linear_w8a8_static(x: Tensor, weight: Tensor, input_scale: Tensor, input_offset: Tensor, deq_scale: Tensor,
                       out_dtype: torch.dtype, quant_bias=None) -> Tensor:
    """x [N, K] float, weight [Nout, K] int8, input_scale / input_offset [1] float32, deq_scale [Nout]
    float32, quant_bias [Nout] int32? -> [N, Nout] out_dtype: x quantised with the static scale
    (float32 division then addition, ties to even, clamped), the int8 product exact (float64
    matmul), plus quant_bias exactly (int64), then float32 * deq_scale, one cast."""
    xq = torch.round(x.float() / input_scale + input_offset).nan_to_num_(0.0).clamp_(-128, 127).to(torch.int8)
    acc = (xq.double() @ weight.double().T).to(torch.int64)
    if quant_bias is not None:
        acc = acc + quant_bias.to(torch.int64)
    return (acc.float() * deq_scale).to(out_dtype)
