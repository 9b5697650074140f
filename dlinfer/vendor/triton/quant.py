"""W8A8: dynamic per-token int8 quantisation, RMSNorm fused with it, and the int8 linear.

Quantisation (one program per row, the whole row in one block, as norm.py): fp32 after the load,
scale = amax / 127 correctly rounded (`tl.div_rn`), the quotient x / scale correctly rounded to
fp32, round half to even, clamp to [-128, 127]: the torch vendor's bytes and scales exactly. The
quotient has two forms, both giving the correctly rounded fp32 quotient (`quotient_form`):
  0 div_rn: a correctly rounded division per element, rounding with floor (the H200 found the
    kernel issue-bound with it, docs/gpu.md);
  1 recip64 (the default): x times the float64 reciprocal of the scale, in float64, rounded once to
    fp32. The float64 product is within ~2**-52 (relative) of x / scale, and x / scale for fp32 x
    and scale is never within 2**-49 of a point halfway between two fp32 values (it is never
    exactly one: a quotient with 25 significant bits would need a 25-bit x), so rounding the
    product gives the correctly rounded quotient (subnormal scales included: they are normal in
    float64). Form 1 rounds half to even with 1.5 * 2**23 added and subtracted (exact for |q| <
    2**22; |q| is at most ~190, reached with subnormal scales, before the clamp) and finds a NaN
    row through the same NaN-propagating max that gives amax.
An fp32 form (Markstein's correction, y = RN(1 / s), q = RN(x y), two fmas) was tried and dropped:
q = RN(x RN(1 / s)) can be more than an ulp from x / s, outside what the correction's proof needs.
rms_norm_w8a8 / add_rms_norm_w8a8: norm.py's arithmetic for the row (the norm rounded to the
activation dtype), then the quantisation of those values, in one program.
linear_w8a8: program = (BLOCK_M rows, BLOCK_N output channels); int8 tiles into
tl.dot(out_dtype=int32), exact (int32 wraps only past the contract's K); epilogue
((float)acc * rms_scale) * linear_scale (+ bias) in fp32, one rounding to out_dtype.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from dlinfer.vendor.triton._common import cast_to, next_pow2, row_warps, unit_stride


@triton.jit
def round_half_even(v):
    """fp32 -> nearest integer (as fp32), ties to the even one."""
    f = tl.floor(v)
    d = v - f  # exact
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quotient(x, d, FORM: tl.constexpr):
    """x (fp32 block) / d (fp32 scalar, > 0 or +inf), correctly rounded to fp32, by FORM (module
    docstring)."""
    if FORM == 1:
        return (x.to(tl.float64) * (1.0 / d.to(tl.float64))).to(tl.float32)
    else:
        return tl.div_rn(x, tl.zeros_like(x) + d)


@triton.jit
def quantize(x, FORM: tl.constexpr):
    """x: fp32 row block (padding 0) -> (q int8, scale fp32 scalar): dynamic_quant's rule. A row
    holding a NaN gets scale NaN and codes 0 (tl.max, like fmax, would skip the NaN and hide it
    from the next linear_w8a8). FORM: the quotient's form (module docstring)."""
    if FORM == 0:
        amax = tl.max(tl.abs(x), axis=0)
        has_nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
    else:
        amax = tl.reduce(tl.abs(x), 0, _max_keep_nan)
        has_nan = amax != amax
    scale = tl.where(has_nan, float("nan"), tl.div_rn(amax, 127.0))
    div = tl.where((scale == 0.0) | has_nan, 1.0, scale)
    if FORM == 0:
        q = round_half_even(quotient(x, div, FORM))
    else:
        q = (quotient(x, div, FORM) + 12582912.0) - 12582912.0  # 1.5 * 2**23: ties to even (|q| < 2**22)
    q = tl.where(has_nan, 0.0, tl.minimum(tl.maximum(q, -128.0), 127.0))
    return q.to(tl.int8), scale


def quotient_form() -> int:
    """The quotient's form the launchers use (module docstring): 1, the float64 reciprocal, which
    the H200 measured faster with the same codes (docs/gpu.md); benchmarks/gpu_tile_sweep.py
    replaces this function to time form 0 against it. A GPU whose float64 rate is a small
    fraction of its float32 one may prefer form 0: the codes are the same either way."""
    return 1


@triton.jit
def _dynamic_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, BLOCK_K: tl.constexpr, FORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize(x, FORM)
    tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: Tensor):
    """x [N, K] (any float dtype, last dim dense) -> (q [N, K] int8, scale [N] float32)."""
    n, k = x.shape
    q = torch.empty((n, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((n,), dtype=torch.float32, device=x.device)
    if n:
        block = next_pow2(k)
        _dynamic_quant_kernel[(n,)](x, q, scale, x.stride(0), q.stride(0), k, BLOCK_K=block, FORM=quotient_form(),
                                    num_warps=row_warps(block))
    return q, scale


def dynamic_quant(x: Tensor):
    """x [N, K] float -> (xq [N, K] int8, scale [N] float32)."""
    return quantize_rows(unit_stride(x))


@triton.jit
def _rms_norm_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, sum_ptr, stride_x, stride_r, stride_sum, H, eps,
                           HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, FORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # norm.py's steps, so the values quantised are the ones rms_norm writes
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = cast_to(x + r, dtype)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = cast_to(x * tl.rsqrt(var + eps), dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = cast_to(y * w, dtype).to(tl.float32)
    q, scale = quantize(tl.where(mask, normed, 0.0), FORM)
    tl.store(q_ptr + row * H + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


def _norm_quant(x: Tensor, r, weight: Tensor, epsilon: float):
    n, h = x.shape
    q = torch.empty((n, h), dtype=torch.int8, device=x.device)
    scale = torch.empty((n,), dtype=torch.float32, device=x.device)
    summed = torch.empty((n, h), dtype=x.dtype, device=x.device) if r is not None else None
    if n:
        block = next_pow2(h)
        _rms_norm_quant_kernel[(n,)](
            x, r if r is not None else x, unit_stride(weight), q, scale, summed if r is not None else q,
            x.stride(0), r.stride(0) if r is not None else 0, summed.stride(0) if r is not None else 0,
            h, float(epsilon), HAS_RESIDUAL=r is not None, BLOCK_H=block, FORM=quotient_form(),
            num_warps=row_warps(block),
        )
    return q, scale, summed


def rms_norm_w8a8(hidden_states: Tensor, weight: Tensor, epsilon: float):
    """hidden_states [N, H], weight [H] -> (xq [N, H] int8, scale [N] float32)."""
    q, scale, _ = _norm_quant(unit_stride(hidden_states), None, weight, epsilon)
    return q, scale


def add_rms_norm_w8a8(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float):
    """([N, H], [N, H], [H]) -> (xq [N, H] int8, scale [N] float32, h + r [N, H])."""
    return _norm_quant(unit_stride(hidden_states), unit_stride(residual), weight, epsilon)


@triton.jit
def _linear_w8a8_kernel(a_ptr, b_ptr, rs_ptr, ls_ptr, bias_ptr, out_ptr, M, N, K, stride_am, stride_bn, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok, n_ok = m < M, n < N
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + m[:, None] * stride_am + kk[None, :]
    b_ptrs = b_ptr + n[None, :] * stride_bn + kk[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    rs = tl.load(rs_ptr + m, mask=m_ok, other=0.0)
    ls = tl.load(ls_ptr + n, mask=n_ok, other=0.0)
    v = acc.to(tl.float32) * rs[:, None]
    v = v * ls[None, :]
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], cast_to(v, out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def linear_w8a8(a: Tensor, b: Tensor, rms_scale: Tensor, linear_scale: Tensor, out_dtype: torch.dtype, bias=None):
    """a [M, K] int8, b [N, K] int8, rms_scale [M], linear_scale [N] or [N, 1] float32 (read as N values),
    bias [N]? -> [M, N] out_dtype."""
    a, b = unit_stride(a), unit_stride(b)
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps = _linear_tiles(m)
    _linear_w8a8_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a, b, rms_scale.contiguous(), linear_scale.contiguous(), bias.contiguous() if bias is not None else out, out,
        m, n, k, a.stride(0), b.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3,
    )
    return out


def _linear_tiles(m: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of linear_w8a8 for M rows. Decode-sized M streams the
    weight in narrow tiles; prefill-sized M takes 128 x 128 tiles over 128-byte K steps (the int8
    tensor-core shape), 8 warps. Every launch fits sm_80's shared memory (scripts/triton_targets.py)."""
    if m <= 16:
        return 16, 64, 64, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 128, 128, 8

