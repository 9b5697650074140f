"""The cpu vendor's op functions: each binds a C++ kernel (`csrc/<family>.cpp`, a function of the
extension module `build.module()`, csrc/bindings.cpp) to its canonical signature (dlinfer/vendor/op_table.py).

Importing this module builds the kernels if need be (`build.module()`). Shapes: T tokens, N rows, H
hidden size, Hq / Hkv heads, D / Dv head dims, NB blocks, BS block size, B sequences, M max blocks
per sequence, R rotary dims. The caches reach the kernels as `kv_layouts.canonical` views,
[NB, BS, Hkv, D] whatever the layout, so no kernel knows about layouts.

The kernels read rows through their strides but need each row's last dim dense: the C++ side
copies an input or output whose last dim is strided (`dense_rows` in csrc/common.h); a cache whose
last dim is strided (which no engine allocates) is sent to the torch vendor's function, which takes
any strides, by an explicit check here (`_rows_dense`) before the kernel is called.
"""

from typing import Optional

import torch
from torch import Tensor

from dlinfer.vendor.cpu import build
from dlinfer.vendor.kv_layouts import canonical
from dlinfer.vendor.torch import attention as torch_attention
from dlinfer.vendor.torch import kv_cache as torch_kv_cache
from dlinfer.vendor.torch import linear as torch_linear

_kernels = build.module()
_rms_norm = _kernels.rms_norm
_add_rms_norm = _kernels.add_rms_norm
_rotary = _kernels.apply_rotary_pos_emb
_silu_and_mul = _kernels.silu_and_mul
_fill = _kernels.fill_kv_cache
_decode = _kernels.paged_decode_attention
_prefill = _kernels.prefill_attention
_paged_prefill = _kernels.paged_prefill_attention
_few_rows = _kernels.linear_few_rows
_few_rows_16bit = _kernels.linear_few_rows_16bit
MAX_ROWS = torch.ops.dlinfer_cpu.max_few_rows()  # linear's C++ kernels up to this many rows
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _as_read(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t as the kernels read it: as stored when float32 or `dtype` (the activations') and dense,
    else converted (a float64 or other-dtype weight: not what an engine passes)."""
    if t.dtype != torch.float32 and t.dtype != dtype:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """hidden_states [N, H], weight [H] -> [N, H] in hidden_states' dtype. The weight is read as
    stored (float32 or hidden_states' dtype), widened in registers."""
    return _rms_norm(hidden_states, _as_read(weight, hidden_states.dtype), epsilon)


def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float):
    """([N, H], [N, H], [H]) -> (rms_norm(h + r) [N, H], h + r [N, H]); the sum in the activation dtype."""
    return _add_rms_norm(hidden_states, residual, _as_read(weight, hidden_states.dtype), epsilon)


def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor):
    """query [T, Hq, D], key [T, Hkv, D], cos/sin [T, R] -> new (q [T, Hq, D], k [T, Hkv, D]).
    cos / sin are read as stored (float32 or the query's dtype)."""
    if cos.dtype != sin.dtype:
        cos, sin = cos.float(), sin.float()
    return _rotary(query, key, _as_read(cos, query.dtype), _as_read(sin, query.dtype))


def silu_and_mul(x: Tensor) -> Tensor:
    """x [N, 2I] -> silu(x[:, :I]) * x[:, I:]  [N, I]."""
    return _silu_and_mul(x)


def _rows_dense(key_cache: Tensor, value_cache: Tensor) -> bool:
    """Whether both caches' last dim (D) is dense, as the C++ kernels read each row. A cache with a
    strided last dim (no engine allocates one) goes to the torch vendor's function, which takes any
    strides; the kernels check it again and raise, so nothing reaches them otherwise."""
    return key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1


def fill_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, kv_indices: Tensor,
                  kv_layout: str, k_scale: Optional[Tensor] = None, k_zero: Optional[Tensor] = None,
                  v_scale: Optional[Tensor] = None, v_zero: Optional[Tensor] = None) -> None:
    """Write key [T, Hkv, D] / value [T, Hkv, Dv] into the caches (in `kv_layout`, written in place)
    at slots kv_indices [T]; slots outside [0, NB*BS) are skipped. With k_scale etc. ([Hkv]
    float32) the caches are int8 and each element is quantised on the way in (C++)."""
    if not _rows_dense(key_cache, value_cache):
        torch_kv_cache.fill_kv_cache(key, value, key_cache, value_cache, kv_indices, kv_layout, k_scale, k_zero,
                                     v_scale, v_zero)
        return
    _fill(key, value, canonical(key_cache, kv_layout), canonical(value_cache, kv_layout), kv_indices.contiguous(),
          k_scale, k_zero, v_scale, v_zero)


def paged_decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                           cu_seqlens_q: Tensor, kv_seq_len: Tensor, max_kv_seq_len: int, softmax_scale: float,
                           alibi_slopes: Optional[Tensor], out: Tensor, kv_layout: str,
                           k_scale: Optional[Tensor] = None,
                           k_zero: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                           v_zero: Optional[Tensor] = None, sliding_window: int = 0,
                           logit_softcapping: float = 0.0) -> None:
    """query [T, Hq, D], caches in `kv_layout`, block_table [B, M], cu_seqlens_q [B+1],
    kv_seq_len [B], alibi_slopes [Hq]? -> out [T, Hq, Dv] (written in place). With k_scale etc.
    ([Hkv] float32) the caches are int8, read in place and dequantised in registers (C++; k_zero
    drops out of the softmax unless scores are soft-capped, see csrc/attention.cpp). A sliding
    window skips the blocks before it."""
    if not _rows_dense(key_cache, value_cache):
        torch_attention.paged_decode_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len,
                                               max_kv_seq_len, softmax_scale, alibi_slopes, out, kv_layout, k_scale,
                                               k_zero, v_scale, v_zero, sliding_window, logit_softcapping)
        return
    _decode(query, canonical(key_cache, kv_layout), canonical(value_cache, kv_layout), block_table.contiguous(),
            cu_seqlens_q.contiguous(), kv_seq_len.contiguous(), max_kv_seq_len, softmax_scale,
            None if alibi_slopes is None else alibi_slopes.contiguous(), out, k_scale, v_scale, v_zero, k_zero,
            sliding_window, logit_softcapping)


def prefill_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, max_q_seq_len: int,
                      softmax_scale: float, alibi_slopes: Optional[Tensor], out: Tensor, sliding_window: int = 0,
                      logit_softcapping: float = 0.0) -> None:
    """query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv], cu_seqlens_q [B+1], alibi_slopes [Hq]?
    -> out [T, Hq, Dv] (written in place): causal attention within each sequence, flash-style
    (C++, csrc/prefill_attention.cpp)."""
    _prefill(query, key, value, cu_seqlens_q.contiguous(), softmax_scale,
             None if alibi_slopes is None else alibi_slopes.contiguous(), out, sliding_window, logit_softcapping)


def paged_prefill_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                            cu_seqlens_q: Tensor, kv_seq_len: Tensor, max_q_seq_len: int, max_kv_seq_len: int,
                            softmax_scale: float, alibi_slopes: Optional[Tensor], out: Tensor, kv_layout: str,
                            k_scale: Optional[Tensor] = None, k_zero: Optional[Tensor] = None,
                            v_scale: Optional[Tensor] = None, v_zero: Optional[Tensor] = None,
                            sliding_window: int = 0, logit_softcapping: float = 0.0) -> None:
    """query [T, Hq, D] (each sequence's new tokens), caches in `kv_layout`, block_table [B, M],
    cu_seqlens_q [B+1], kv_seq_len [B] (history + new), alibi_slopes [Hq]? -> out [T, Hq, Dv]
    (written in place): the new tokens over the paged history and themselves, read from the cache
    in place, flash-style (C++). int8 caches (k_scale etc. [Hkv] float32) are widened per chunk."""
    if not _rows_dense(key_cache, value_cache):
        torch_attention.paged_prefill_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len,
                                                max_q_seq_len, max_kv_seq_len, softmax_scale, alibi_slopes, out,
                                                kv_layout, k_scale, k_zero, v_scale, v_zero, sliding_window,
                                                logit_softcapping)
        return
    _paged_prefill(query, canonical(key_cache, kv_layout), canonical(value_cache, kv_layout),
                   block_table.contiguous(), cu_seqlens_q.contiguous(), kv_seq_len.contiguous(), softmax_scale,
                   None if alibi_slopes is None else alibi_slopes.contiguous(), out, k_scale, v_scale, v_zero, k_zero,
                   sliding_window, logit_softcapping)


def uses_few_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether `linear(x, weight, bias)` runs a C++ few-row kernel: x and weight both float32
    (csrc/linear.cpp) or both bfloat16 / float16 (csrc/linear_16bit.cpp), at most MAX_ROWS rows,
    dense rows and weight, bias absent or dense in x's dtype; inference only (a call autograd
    would record keeps the torch path)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if x.dtype != weight.dtype or x.dtype not in _FLOATS:
        return False
    return (x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x [N, K], weight [Nout, K], bias [Nout]? -> [N, Nout]: the few-rows C++ kernels (a
    weight-streaming matrix-vector product; 16-bit weights read as stored, float32 sums) where
    `uses_few_rows`, else the torch vendor's path."""
    if uses_few_rows(x, weight, bias):
        if x.dtype == torch.float32:
            return _few_rows(x, weight, bias)
        return _few_rows_16bit(x, weight, bias, -1)  # -1: the best path for the dtype
    return torch_linear.linear(x, weight, bias)


# W8A8 (csrc/quant_w8.cpp, csrc/moe_w8.cpp, csrc/int8_gemm.cpp): results bit-identical to the torch
# vendor's, except fused_moe_w8a8's silu (ATen's vectorised exp).
_dynamic_quant = _kernels.dynamic_quant
_linear_w8a8 = _kernels.linear_w8a8
_rms_norm_w8a8 = _kernels.rms_norm_w8a8
_add_rms_norm_w8a8 = _kernels.add_rms_norm_w8a8
_fused_moe_w8a8 = _kernels.fused_moe_w8a8


def dynamic_quant(x: Tensor):
    """x [N, K] float -> (xq [N, K] int8, scale [N] float32), one pass per row."""
    return _dynamic_quant(x)


def linear_w8a8(a: Tensor, b: Tensor, rms_scale: Tensor, linear_scale: Tensor, out_dtype: torch.dtype,
                bias: Optional[Tensor]) -> Tensor:
    """a [M, K] int8, b [N, K] int8, rms_scale [M], linear_scale [N] or [N, 1] float32, bias [N]? -> [M, N] out_dtype.
    The int8 product: a weight-streaming VNNI / int16 kernel up to 8 rows; beyond, oneDNN's int8 GEMM
    on CPUs with VNNI, else the same kernels over blocks of the weight."""
    return _linear_w8a8(a, b, rms_scale, linear_scale, out_dtype, bias, -1)  # -1: the best path


def rms_norm_w8a8(hidden_states: Tensor, weight: Tensor, epsilon: float):
    """hidden_states [N, H], weight [H] -> (xq [N, H] int8, scale [N] float32) of this vendor's rms_norm."""
    return _rms_norm_w8a8(hidden_states, _as_read(weight, hidden_states.dtype), epsilon)


def add_rms_norm_w8a8(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float):
    """([N, H], [N, H], [H]) -> (xq [N, H] int8, scale [N] float32, h + r [N, H])."""
    return _add_rms_norm_w8a8(hidden_states, residual, _as_read(weight, hidden_states.dtype), epsilon)


def fused_moe_w8a8(hidden_states: Tensor, gate_up_weights: Tensor, gate_up_scales: Tensor, down_weights: Tensor,
                   down_scales: Tensor, topk_weights: Tensor, topk_ids: Tensor, renormalize: bool) -> Tensor:
    """hidden [T, H], int8 gate_up [E, 2I, H] + scales [E, 2I], int8 down [E, H, I] + scales [E, H],
    topk weights / ids [T, K] -> [T, H] in hidden's dtype."""
    return _fused_moe_w8a8(hidden_states, gate_up_weights, gate_up_scales, down_weights, down_scales, topk_weights,
                           topk_ids, renormalize)
