"""Independent float64 references for the quantised ops (W8A8, W4A16, fused_moe_w8a8, static
W8A8): integer products exact in int64, rounding rules spelled out. Re-exported by reference.py.
Nothing here imports dlinfer's ops or vendors."""

import torch

from dlinfer.conformance._ref_base import F64, _f64, _round_half_even, rms_norm, silu

# ---------------------------------------------------------------- W8A8 (int8 symmetric)


def dynamic_quant(x):
    """Per-row int8: scale = amax|x| / 127 rounded to float32 (the contract's scale dtype), then
    q = clamp(round_half_even(x / scale rounded to float32), -128, 127); a zero row: scale 0, q 0.

    float64 results rounded once to float32 equal float32's correctly rounded division (both
    operands are floats, 53 >= 2 * 24 + 2), so this is the contract's float32 arithmetic, exactly.
    Returns (q int8 on the CPU, scale as float64 of the float32 value).
    """
    v = _f64(x)
    amax = v.abs().amax(dim=-1) if v.shape[-1] else torch.zeros(v.shape[:-1], dtype=F64)
    scale = (amax / 127.0).to(torch.float32).to(F64)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    ratio = (v / divisor.unsqueeze(-1)).to(torch.float32).to(F64)
    q = _round_half_even(ratio).clamp(-128.0, 127.0)
    return q.to(torch.int8), scale


def int8_product(a, b):
    """Exact integer a [M, K] @ b [N, K].T as int64 [M, N]: per row, products summed in int64."""
    A = a.detach().cpu().to(torch.int64)
    B = b.detach().cpu().to(torch.int64)
    out = torch.zeros(A.shape[0], B.shape[0], dtype=torch.int64)
    for i in range(A.shape[0]):
        out[i] = (B * A[i]).sum(dim=-1)
    return out


def linear_w8a8(a, b, rms_scale, linear_scale, bias=None):
    """(a @ b.T, exact) * rms_scale[..., None] * linear_scale (+ bias), float64, [..., N]."""
    lead = a.shape[:-1]
    acc = int8_product(a.reshape(-1, a.shape[-1]), b).to(F64)
    out = acc * _f64(rms_scale).reshape(-1, 1) * _f64(linear_scale).reshape(1, -1)
    if bias is not None:
        out = out + _f64(bias)
    return out.reshape(*lead, b.shape[0])


def rms_norm_w8a8(hidden_states, weight, epsilon):
    """dynamic_quant of rms_norm rounded to the activation dtype; also returns that norm (float64)."""
    normed = rms_norm(hidden_states, weight, epsilon).to(hidden_states.dtype)
    q, scale = dynamic_quant(normed)
    return q, scale, _f64(normed)


def add_rms_norm_w8a8(hidden_states, residual, weight, epsilon):
    """(q, scale, h + r rounded to the activation dtype, the norm) of rms_norm_w8a8(h + r)."""
    s = (_f64(hidden_states) + _f64(residual)).to(hidden_states.dtype)
    q, scale, normed = rms_norm_w8a8(s, weight, epsilon)
    return q, scale, _f64(s), normed


# ---------------------------------------------------------------- W4A16 (AWQ gemm layout)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of word j holds column 8 * j + AWQ_ORDER[i]


def awq_unpack(packed):
    """int32 [R, W] (AWQ gemm packing) -> int64 [R, 8 * W] of values 0..15, column by column."""
    P = packed.detach().cpu().to(torch.int64) & 0xFFFFFFFF  # the 32 bits, unsigned
    out = torch.zeros(P.shape[0], 8 * P.shape[1], dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out[:, col::8] = (P >> (4 * i)) & 0xF
    return out


def weight_quant_matmul(x, qweight, scale, offset, bias, group_size):
    """x [..., K] @ W (+ bias), float64 [..., N]: W[k, c] = (q[k, c] - z[k // g, c]) * s[k // g, c]
    from a canonical qweight int32 [K, N/8], scale [K/g, N], offset int32 [K/g, N/8] or None (8)."""
    q = awq_unpack(qweight)
    K, N = q.shape
    g = group_size or K
    z = torch.full((K // g, N), 8, dtype=torch.int64) if offset is None else awq_unpack(offset)
    w = torch.empty(K, N, dtype=F64)
    s = _f64(scale)
    for k in range(K):
        w[k] = (q[k] - z[k // g]).to(F64) * s[k // g]
    out = _f64(x).reshape(-1, K) @ w
    if bias is not None:
        out = out + _f64(bias)
    return out.reshape(*x.shape[:-1], N)


def _quant_steps_in_doubt(act, delta):
    """act float64 [I] -> bool [I]: elements whose int8 value (dynamic_quant of the row) may differ
    by one step when act and its row's scale are each off by up to a relative delta."""
    amax = float(act.abs().max()) if act.numel() else 0.0
    if amax == 0.0:
        return torch.zeros(act.shape, dtype=torch.bool)
    scale = amax / 127.0
    a = act.abs()
    low = _round_half_even(a * (1 - delta) / (scale * (1 + delta))).clamp(max=127.0)
    high = _round_half_even(a * (1 + delta) / (scale * (1 - delta))).clamp(max=127.0)
    return low != high


def fused_moe_w8a8(hidden_states, gate_up_weights, gate_up_scales, down_weights, down_scales, topk_weights,
                   topk_ids, renormalize, delta=2.0**-18):
    """The W8A8 expert MLP, per (token, expert), with the contract's exact steps: x quantised per
    token (dynamic_quant above), exact int8 products, silu(gate) * up in float64, quantised per
    token, exact int8 product with the down weights. Returns (out [T, H], slack [T, H], in doubt):

    act is float32 in the contract, a few float32 roundings (<< delta) away from the float64 value
    here, so an element of act whose quantised value depends on those roundings (see
    `_quant_steps_in_doubt`) may legitimately land one step away; slack[t] sums, over such elements,
    the output change one step makes (|w| * a_scale * |down[:, i]| * down_scale). `in doubt` is the
    fraction of act elements in doubt (a check can require it small, so the slack stays small).
    """
    xq, xs = dynamic_quant(hidden_states)
    gus = _f64(gate_up_scales).reshape(gate_up_weights.shape[0], -1)
    dns = _f64(down_scales).reshape(down_weights.shape[0], -1)
    dn_abs = down_weights.detach().cpu().to(torch.int64).abs().to(F64)
    w = _f64(topk_weights)
    ids = topk_ids.detach().cpu().to(torch.int64)
    T, H = hidden_states.shape
    inter = gate_up_weights.shape[1] // 2
    out = torch.zeros(T, H, dtype=F64)
    slack = torch.zeros(T, H, dtype=F64)
    doubtful, total = 0, 0
    for t in range(T):
        wt = w[t] / w[t].sum() if renormalize else w[t]
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = int8_product(xq[t:t + 1], gate_up_weights[e])[0].to(F64) * xs[t] * gus[e]
            act = silu(gu[:inter]) * gu[inter:]
            aq, a_scale = dynamic_quant(act.unsqueeze(0))
            y = int8_product(aq, down_weights[e])[0].to(F64) * a_scale[0] * dns[e]
            out[t] += wt[k] * y
            doubt = _quant_steps_in_doubt(act, delta)
            doubtful, total = doubtful + int(doubt.sum()), total + doubt.numel()
            slack[t] += abs(float(wt[k])) * float(a_scale[0]) * (dn_abs[e] @ doubt.to(F64)) * dns[e].abs()
    return out, slack, doubtful / max(total, 1)


def linear_w8a8_static(x, weight, input_scale, input_offset, deq_scale, quant_bias=None):
    """ModelSlim static W8A8: xq = clamp(round_half_even(x / s + o), -128, 127) with the contract's
    float32 steps (each float64 result rounded once to float32: the correctly rounded float32
    division and sum), then (xq @ weight.T exact + quant_bias) * deq_scale in float64 [..., N]."""
    f32 = torch.float32
    s, o = _f64(input_scale).reshape(()), _f64(input_offset).reshape(())
    ratio = (_f64(x.float()) / s).to(f32).to(F64)
    xq = _round_half_even((ratio + o).to(f32).to(F64)).clamp(-128.0, 127.0).to(torch.int8)
    lead = x.shape[:-1]
    acc = int8_product(xq.reshape(-1, x.shape[-1]), weight)
    if quant_bias is not None:
        acc = acc + quant_bias.detach().cpu().to(torch.int64)
    return (acc.to(F64) * _f64(deq_scale)).reshape(*lead, weight.shape[0])
