"""fused_moe_w8a8: the W8A8 expert MLP, on moe.py's alignment and combine (no host sync).

  1. x quantised per token (quant.py's row kernel): xq [T, H] int8, x_scale [T].
  2. moe.py's align: (token, k) pairs sorted by expert into BLOCK_M-row blocks.
  3. gate/up: program (row block, column block of I); gathered xq rows times the expert's int8
     gate and up tiles, two tl.dot(out_dtype=int32) accumulators (exact); epilogue
     g = ((float)acc_g * x_scale) * gate_up_scale[e, n] (u alike), act = g * sigmoid(g) * u
     (sigmoid from exp(-|g|), which cannot overflow), fp32, row = pair id.
  4. act quantised per pair row (quant.py's row kernel): aq [T*K, I] int8, a_scale [T*K].
  5. down: aq rows times the expert's int8 down tiles, int32 accumulation; epilogue
     y = ((float)acc * a_scale) * down_scale[e, n] in fp32 -> y [T*K, H].
  6. moe.py's combine: out[t] = sum_k w[t, k] * y[t*K + k] in fp32 (w renormalised when asked;
     ids outside [0, E) count as zero), one rounding to the activation dtype.
BLOCK_M 16, BLOCK_N 64, BLOCK_K 64 (int8 tl.dot needs K tiles of at least 32).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor.triton._common import next_pow2
from dlinfer.vendor.triton.moe import _moe_combine_kernel, moe_align
from dlinfer.vendor.triton.quant import quantize_rows

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _gate_up_w8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, sorted_ptr, block_expert_ptr, n_pairs, E, H, I,
                       stride_xt, stride_we, stride_wn, stride_se, stride_am,
                       TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < n_pairs
    tokens = tl.where(row_ok, pairs // TOPK, 0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = n < I
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = xq_ptr + tokens[:, None] * stride_xt + kk[None, :]
    g_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = k0 + kk < H
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
        bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc_g += tl.dot(a, bg, out_dtype=tl.int32)
        acc_u += tl.dot(a, bu, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    xs = tl.load(xs_ptr + tokens, mask=row_ok, other=0.0)
    sg = tl.load(ws_ptr + expert * stride_se + n, mask=n_ok, other=0.0)
    su = tl.load(ws_ptr + expert * stride_se + I + n, mask=n_ok, other=0.0)
    g = acc_g.to(tl.float32) * xs[:, None]
    g = g * sg[None, :]
    u = acc_u.to(tl.float32) * xs[:, None]
    u = u * su[None, :]
    e = tl.exp(-tl.abs(g))  # silu(g) = g * sigmoid(g), exp never overflows
    act = g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * u
    out = act_ptr + pairs.to(tl.int64)[:, None] * stride_am + n[None, :]
    tl.store(out, act, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_w8_kernel(aq_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, n_pairs, E, H, I,
                    stride_am, stride_we, stride_wn, stride_se, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < n_pairs
    rows = tl.where(row_ok, pairs, 0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = n < H
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = aq_ptr + rows[:, None] * stride_am + kk[None, :]
    b_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = k0 + kk < I
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_scale = tl.load(as_ptr + rows, mask=row_ok, other=0.0)
    s = tl.load(ws_ptr + expert * stride_se + n, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * a_scale[:, None]
    y = y * s[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + n[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_w8a8(hidden_states: Tensor, gate_up_weights: Tensor, gate_up_scales: Tensor, down_weights: Tensor,
                   down_scales: Tensor, topk_weights: Tensor, topk_ids: Tensor, renormalize: bool) -> Tensor:
    """hidden [T, H], int8 gate_up [E, 2I, H] + f32 scales [E, 2I], int8 down [E, H, I] + f32 scales [E, H],
    weights / ids [T, K] -> [T, H] in hidden's dtype."""
    t, h = hidden_states.shape
    num_experts, two_i, _ = gate_up_weights.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    dev = hidden_states.device
    out = torch.empty((t, h), dtype=hidden_states.dtype, device=dev)
    if t == 0:
        return out
    gate_up_weights, down_weights = gate_up_weights.contiguous(), down_weights.contiguous()
    gate_up_scales, down_scales = gate_up_scales.contiguous(), down_scales.contiguous()
    n_pairs = t * topk
    xq, x_scale = quantize_rows(hidden_states.contiguous())
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, BLOCK_M)
    n_blocks = block_expert.numel()
    act = torch.zeros((n_pairs, inter), dtype=torch.float32, device=dev)  # pairs of foreign ids stay 0
    _gate_up_w8_kernel[(n_blocks, triton.cdiv(inter, BLOCK_N))](
        xq, x_scale, gate_up_weights, gate_up_scales, act, sorted_ids, block_expert, n_pairs, num_experts, h, inter,
        xq.stride(0), gate_up_weights.stride(0), gate_up_weights.stride(1), gate_up_scales.stride(0), act.stride(0),
        TOPK=topk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
    )
    aq, a_scale = quantize_rows(act)
    y = torch.empty((n_pairs, h), dtype=torch.float32, device=dev)
    _down_w8_kernel[(n_blocks, triton.cdiv(h, BLOCK_N))](
        aq, a_scale, down_weights, down_scales, y, sorted_ids, block_expert, n_pairs, num_experts, h, inter,
        aq.stride(0), down_weights.stride(0), down_weights.stride(1), down_scales.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
    )
    block_h = min(next_pow2(h), 1024)
    _moe_combine_kernel[(t, triton.cdiv(h, block_h))](
        y, topk_weights, topk_ids, out, num_experts, h, *topk_weights.stride(), *topk_ids.stride(),
        y.stride(0), out.stride(0), TOPK=topk, BLOCK_TOPK=next_pow2(topk), RENORMALIZE=bool(renormalize),
        BLOCK_H=block_h, num_warps=4,
    )
    return out
