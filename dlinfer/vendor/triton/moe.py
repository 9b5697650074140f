"""MoE router (softmax + top-k) and the fused SwiGLU expert MLP.

moe_gating_topk_softmax: program = BLOCK_T rows x all E logits (BLOCK_E = next pow2 of E).
  fp32 softmax per row, then K rounds of arg-max: the largest probability, the lowest expert id
  among equal ones, which is then knocked out. Weights f32, ids int64, descending.

fused_moe, four launches and no host sync:
  1. align (one program): the T*K (token, k) pairs are counted per expert, each expert's
     segment is padded to a multiple of BLOCK_M, and pair ids are scattered into `sorted`
     (stable within an expert; padding holds the sentinel T*K). block_expert[b] names the expert
     of each BLOCK_M rows (E for blocks past the end). Buffers are sized by the upper bound
     T*K + E*(BLOCK_M-1), so the grids below never depend on data.
  2. gate/up GEMM: program (row block, column block of I). Rows are gathered token rows of x;
     the gate and up tiles of the expert's weight run side by side (two tl.dot accumulators),
     the epilogue writes act = silu(gate) * up in the activation dtype, row = pair id.
  3. down GEMM: act rows of the block times the expert's down weight -> y [T*K, H] in fp32.
  4. combine: out[t] = sum_k w[t,k] * y[t*K + k] in fp32 (w renormalised first when asked;
     pairs with an expert id outside [0, E) count as zero), one rounding to the activation dtype.
Tiles: BLOCK_M 16/32/64 by the average number of pairs per expert, BLOCK_N 64 (128 with
BLOCK_M 64), BLOCK_K 64 (32 for fp32); all >= 16, as tl.dot needs, the edges masked.
fp32 operands use input_precision="ieee" (no TF32); half operands run on tensor cores with
fp32 accumulation. Under the interpreter tiles are upcast to fp32 first (exact for half products).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor.triton._common import INTERPRET, cast_to, hopper, next_pow2

# ---------------------------------------------------------------- router


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_t, stride_e,
                         K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    mask = rmask[:, None] & (cols < E)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :] * stride_e, mask=mask, other=0.0)
    # -inf only in padding columns: rows past T stay finite (no NaN warnings, all masked anyway)
    x = tl.where((cols < E)[None, :], x.to(tl.float32), float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    e = tl.where((cols < E)[None, :], e, 0.0)
    p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(mask, p, -1.0)  # padding columns never win
    for k in tl.static_range(K):
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        idx = tl.minimum(idx, E - 1)  # only a NaN row finds no match; keep ids in range
        tl.store(w_ptr + rows * K + k, best, mask=rmask)
        tl.store(ids_ptr + rows * K + k, idx.to(tl.int64), mask=rmask)
        p = tl.where(cols[None, :] == idx[:, None], -2.0, p)


def moe_gating_topk_softmax(router_logits: Tensor, topk: int):
    """[T, E] -> (weights [T, K] f32, ids [T, K] i64)."""
    t, e = router_logits.shape
    weights = torch.empty((t, topk), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, topk), dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    block_e = next_pow2(e)
    block_t = max(1, min(64, 2048 // block_e))
    _topk_softmax_kernel[(triton.cdiv(t, block_t),)](
        router_logits, weights, ids, t, e, *router_logits.stride(), K=topk, BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=4,
    )
    return weights, ids


# ---------------------------------------------------------------- 1. sort / align


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, n_pairs, E, n_rows,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    # counts per expert (ids outside [0, E) match no expert: those pairs are dropped)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, n_pairs, CHUNK):
        p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]) & (experts < E)[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # scatter pair ids: dest = segment start + pairs of the same expert seen before
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, n_pairs, CHUNK):
        p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=-1)
        hit = ((ids[:, None] == experts[None, :]) & (experts < E)[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit  # earlier hits of the same expert in this chunk
        dest = tl.sum(hit * (starts + seen)[None, :] + hit * rank, axis=1)
        tl.store(sorted_ptr + dest, p, mask=tl.sum(hit, axis=1) > 0)
        seen += tl.sum(hit, axis=0)
    # padding rows get the sentinel; the first row of each block records the block's expert
    for start in range(0, n_rows, CHUNK):
        pos = start + tl.arange(0, CHUNK)
        expert = tl.sum((pos[:, None] >= ends[None, :]).to(tl.int32), axis=1)  # E.. past the end
        sel = (experts[None, :] == expert[:, None]).to(tl.int32)
        local = pos - tl.sum(sel * starts[None, :], axis=1)
        count = tl.sum(sel * counts[None, :], axis=1)
        inside = pos < n_rows
        tl.store(sorted_ptr + pos, tl.zeros_like(pos) + n_pairs, mask=inside & ((expert >= E) | (local >= count)))
        tl.store(block_expert_ptr + pos // BLOCK_M, tl.minimum(expert, E), mask=inside & (pos % BLOCK_M == 0))


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int):
    """(sorted [n_blocks*BLOCK_M] int32 pair ids, block_expert [n_blocks] int32), sized by upper bounds."""
    n_pairs = topk_ids.numel()
    n_blocks = triton.cdiv(n_pairs + num_experts * (block_m - 1), block_m)
    sorted_ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=topk_ids.device)
    block_e = next_pow2(num_experts)
    chunk = max(16, min(1024, 16384 // block_e))
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1).contiguous(), sorted_ids, block_expert, n_pairs, num_experts, n_blocks * block_m,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, num_warps=8,
    )
    return sorted_ids, block_expert


# ---------------------------------------------------------------- 2. gate/up GEMM + SiLU-and-mul


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, n_pairs, E, H, I,
                        stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_am,
                        TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < n_pairs
    tokens = (pairs // TOPK).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = n < I
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + kk[None, :] * stride_xk
    g_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk  # [BK, BN]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = k0 + kk < H
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out = act_ptr + pairs.to(tl.int64)[:, None] * stride_am + n[None, :]
    tl.store(out, cast_to(act, act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------- 3. down GEMM


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, y_ptr, sorted_ptr, block_expert_ptr, n_pairs, E, H, I,
                     stride_am, stride_we, stride_wn, stride_wk, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < n_pairs
    rows = pairs.to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = n < H
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_am + kk[None, :]
    b_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = k0 + kk < I
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    tl.store(y_ptr + rows[:, None] * stride_ym + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------- 4. weighted combine


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, ids_ptr, out_ptr, E, H, stride_wt, stride_wk, stride_it, stride_ik,
                        stride_ym, stride_ot, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                        RENORMALIZE: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    kk = tl.arange(0, BLOCK_TOPK)
    w = tl.load(w_ptr + t * stride_wt + kk * stride_wk, mask=kk < TOPK, other=0.0).to(tl.float32)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)
    ids = tl.load(ids_ptr + t * stride_it + kk * stride_ik, mask=kk < TOPK, other=-1)
    w = tl.where((ids >= 0) & (ids < E), w, 0.0)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        wk = tl.sum(tl.where(kk == k, w, 0.0), axis=0)
        idk = tl.sum(tl.where(kk == k, ids, 0), axis=0)
        ok = h_ok & (idk >= 0) & (idk < E)
        acc += wk * tl.load(y_ptr + (t * TOPK + k) * stride_ym + h, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + h, cast_to(acc, out_ptr.dtype.element_ty), mask=h_ok)


# ---------------------------------------------------------------- launcher


def _tiles(n_pairs: int, num_experts: int, dtype: torch.dtype, wide: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by a simple rule, no autotuning. `wide`
    (`hopper()`: sm_90 / sm_100): from 256 (token, expert) pairs an expert on average, 128-row
    tiles in bf16 / fp16: on an H200 (docs/gpu.md, the tiles step) T = 2048, E = 8, top 2 took 768
    us with 128 x 128 x 64 against 977 with 64 x 128, although the gate-up kernel's two 128 x 128
    fp32 accumulators spill ~1.4 KB there; on sm_80 they would spill ~15 KB
    (scripts/triton_targets.py), so 64 rows."""
    avg = n_pairs / num_experts
    big = wide and avg >= 256 and dtype != torch.float32
    block_m = 16 if avg <= 16 else 32 if avg <= 48 else 128 if big else 64
    block_n = 128 if block_m >= 64 else 64
    block_k = 32 if dtype == torch.float32 else 64
    num_warps = 8 if block_m * block_n >= 8192 else 4
    return block_m, block_n, block_k, num_warps, 2 if dtype == torch.float32 else 3


def fused_moe(hidden_states: Tensor, gate_up_weights: Tensor, down_weights: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, renormalize: bool) -> Tensor:
    """hidden [T, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [T, K] -> [T, H]."""
    t, h = hidden_states.shape
    num_experts, two_i, _ = gate_up_weights.shape
    inter = two_i // 2
    topk = topk_ids.shape[1]
    dev, dtype = hidden_states.device, hidden_states.dtype
    out = torch.empty((t, h), dtype=dtype, device=dev)
    if t == 0:
        return out
    n_pairs = t * topk
    block_m, block_n, block_k, warps, stages = _tiles(n_pairs, num_experts, dtype, hopper(dev))
    upcast = INTERPRET or dtype == torch.float32
    precision = "ieee" if upcast else "tf32"  # "tf32" is the default and unused for half operands

    sorted_ids, block_expert = moe_align(topk_ids, num_experts, block_m)
    n_blocks = block_expert.numel()

    act = torch.empty((n_pairs, inter), dtype=dtype, device=dev)
    _moe_gate_up_kernel[(n_blocks, triton.cdiv(inter, block_n))](
        hidden_states, gate_up_weights, act, sorted_ids, block_expert, n_pairs, num_experts, h, inter,
        *hidden_states.stride(), *gate_up_weights.stride(), act.stride(0),
        TOPK=topk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )
    y = torch.empty((n_pairs, h), dtype=torch.float32, device=dev)
    _moe_down_kernel[(n_blocks, triton.cdiv(h, block_n))](
        act, down_weights, y, sorted_ids, block_expert, n_pairs, num_experts, h, inter,
        act.stride(0), *down_weights.stride(), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )
    block_h = min(next_pow2(h), 1024)
    _moe_combine_kernel[(t, triton.cdiv(h, block_h))](
        y, topk_weights, topk_ids, out, num_experts, h, *topk_weights.stride(), *topk_ids.stride(),
        y.stride(0), out.stride(0), TOPK=topk, BLOCK_TOPK=next_pow2(topk), RENORMALIZE=bool(renormalize),
        BLOCK_H=block_h, num_warps=4,
    )
    return out
