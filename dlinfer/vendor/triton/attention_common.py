"""Pieces shared by the Triton attention kernels: dtype and head-dim rules, paged-cache
addressing, the online-softmax step.

Scores live in log2 units: q.k * softmax_scale * log2(e) (+ slope * log2(e) * (key - query)
for ALiBi), so every exponential is an exp2. A soft cap c is applied to the natural-unit scores
(c tanh(s / c), `soft_cap`) before they are turned into log2 units. A row's running max m and sum l give its
log-sum-exp as m + log2(l), which is what the split-KV decode reduction combines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlinfer.vendor.triton._common import INTERPRET

LOG2E = 1.4426950408889634


def dots_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels upcast Q/K/V to fp32 right after loading them.

    float32: always (and the dots run in IEEE fp32, never TF32: the contract says fp32).
    fp16 / bf16 on a GPU: never; they feed the tensor cores as they are, with fp32 accumulation,
    and the probabilities are rounded to the value dtype for the P @ V dot. Under
    TRITON_INTERPRET=1 bf16 is upcast (the interpreter's bf16 arithmetic is garbage) while fp16
    keeps the GPU's path, so the interpreter checks that path's numerics too.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and INTERPRET)


def block_dim(d: int) -> int:
    """Head dims need not be powers of two (80, 96, ...): pad the tile, mask the tail."""
    return max(16, triton.next_power_of_2(d))


@triton.jit
def paged_slots(bt_row_ptr, stride_bt_m, pos, valid, BS, M, NB):
    """Cache (block id, in-block offset), both int64, of key positions `pos` of one sequence.

    The block table is read only where `valid` and the logical block is < M; ids are clamped into
    [0, NB) so that bad metadata cannot address memory outside the cache (a masked load never
    reads anyway). int64 because block_id * block_stride exceeds 2**31 for caches of 32k+ blocks.
    """
    logical = pos // BS
    ok = valid & (logical < M)
    blk = tl.load(bt_row_ptr + logical.to(tl.int64) * stride_bt_m, mask=ok, other=0).to(tl.int64)
    blk = tl.minimum(tl.maximum(blk, 0), NB - 1)
    return blk, (pos % BS).to(tl.int64)


def score_scale(softmax_scale: float, softcap: float) -> float:
    """What the kernels multiply q.k by: log2 units directly, or natural units when a soft cap
    (`soft_cap`) converts them afterwards."""
    return softmax_scale if softcap else softmax_scale * LOG2E


@triton.jit
def soft_cap(qk, cap):
    """Natural-unit scores -> c tanh(s / c) in log2 units; tanh(x) = 2 / (1 + e^(-2x)) - 1, which
    saturates to +-1 without NaN for any finite x."""
    e = tl.exp2(qk * (-2.0 * 1.4426950408889634 / cap))
    return (cap * 1.4426950408889634) * (2.0 / (1.0 + e) - 1.0)


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, F32: tl.constexpr):
    """Fold one tile of scores qk [R, N] (log2 units, -inf where masked) and values v [N, Dv]
    into the running row max m_i [R], row sum l_i [R] and unnormalised output acc [R, Dv]."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc
