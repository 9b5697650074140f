"""The cpu vendor's call-site bindings for graph compilers (`Vendor.graph_bindings`).

A compiled decode graph calls each op with arguments whose dtypes, shapes and strides are fixed
when the graph is compiled (the `direct` compiler passes them here as FakeTensors). The op
functions in kernels.py / weight_quant.py decide per call what those properties settle: which C++
kernel, whether a weight must be converted or a length tensor made dense, whether the torch
vendor's path takes the call. Here that is decided once per call site; the function returned calls
the C++ kernel straight away. Where the answer is "convert", "copy" or "the torch vendor", the
binding is None and the call site keeps the op function.

What a binding skips, the kernel checks again (dtypes, dense rows and weights, row counts: csrc/
`TORCH_CHECK`s) and raises on: a replayed graph runs without Dynamo's guards, so a call whose
arguments differ from the traced ones (a weight swapped for one of another dtype) fails loudly
instead of being misread. Results are the op functions' own: the same kernels, the same arguments.

A SmolLM2-135M decode step makes ~300 such calls; a bound one costs 0.3-0.7 us less Python (the
checks, the wrapper frame): see docs/graph.md, "Call sites bound once". The direct compiler asks
only for nodes whose tensors have concrete sizes and strides: in LMDeploy's decode graphs the
decode attention is not asked (its block table's width is dynamic there).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from dlinfer.vendor import w4_layouts
from dlinfer.vendor.cpu import kernels, weight_quant
from dlinfer.vendor.kv_layouts import TOKEN_MAJOR

_k = kernels._kernels


def _read_as_is(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether the op function's `kernels._as_read(t, dtype)` hands the kernel t itself (no
    conversion, no copy): asked of the op function's own rule, on the traced FakeTensor."""
    return kernels._as_read(t, dtype) is t


def _dense(*tensors: Optional[Tensor]) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[Callable]:
    if not kernels.uses_few_rows(x, weight, bias):
        return None  # BLAS, the torch vendor's path, chosen per call by kernels.linear
    if x.dtype == torch.float32:
        return _k.linear_few_rows
    few_rows_16bit = _k.linear_few_rows_16bit

    def linear_few_rows_16bit(x, weight, bias):
        return few_rows_16bit(x, weight, bias, -1)  # -1: the best path for the dtype

    return linear_few_rows_16bit


def rms_norm(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Optional[Callable]:
    return _k.rms_norm if _read_as_is(weight, hidden_states.dtype) else None


def add_rms_norm(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> Optional[Callable]:
    return _k.add_rms_norm if _read_as_is(weight, hidden_states.dtype) else None


def rms_norm_w8a8(hidden_states: Tensor, weight: Tensor, epsilon: float) -> Optional[Callable]:
    return _k.rms_norm_w8a8 if _read_as_is(weight, hidden_states.dtype) else None


def add_rms_norm_w8a8(hidden_states: Tensor, residual: Tensor, weight: Tensor,
                      epsilon: float) -> Optional[Callable]:
    return _k.add_rms_norm_w8a8 if _read_as_is(weight, hidden_states.dtype) else None


def apply_rotary_pos_emb(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> Optional[Callable]:
    if cos.dtype != sin.dtype or not (_read_as_is(cos, query.dtype) and _read_as_is(sin, query.dtype)):
        return None
    return _k.apply_rotary_pos_emb


def silu_and_mul(x: Tensor) -> Optional[Callable]:
    return _k.silu_and_mul


def _token_major_dense(key_cache: Tensor, value_cache: Tensor, kv_layout: str) -> bool:
    """Caches the kernels read as they are: token-major (kv_layouts.canonical is the cache itself)
    with dense rows (kernels._rows_dense)."""
    return kv_layout == TOKEN_MAJOR and kernels._rows_dense(key_cache, value_cache)


def fill_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, kv_indices: Tensor,
                  kv_layout: str, k_scale: Optional[Tensor] = None, k_zero: Optional[Tensor] = None,
                  v_scale: Optional[Tensor] = None, v_zero: Optional[Tensor] = None) -> Optional[Callable]:
    if not (_token_major_dense(key_cache, value_cache, kv_layout) and kv_indices.is_contiguous()):
        return None
    fill = _k.fill_kv_cache

    def fill_kv_cache(key, value, key_cache, value_cache, kv_indices, kv_layout, k_scale=None, k_zero=None,
                      v_scale=None, v_zero=None):
        fill(key, value, key_cache, value_cache, kv_indices, k_scale, k_zero, v_scale, v_zero)

    return fill_kv_cache


def paged_decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                           cu_seqlens_q: Tensor, kv_seq_len: Tensor, max_kv_seq_len: int, softmax_scale: float,
                           alibi_slopes: Optional[Tensor], out: Tensor, kv_layout: str,
                           k_scale: Optional[Tensor] = None, k_zero: Optional[Tensor] = None,
                           v_scale: Optional[Tensor] = None, v_zero: Optional[Tensor] = None,
                           sliding_window: int = 0, logit_softcapping: float = 0.0) -> Optional[Callable]:
    if not (_token_major_dense(key_cache, value_cache, kv_layout)
            and _dense(block_table, cu_seqlens_q, kv_seq_len, alibi_slopes)):
        return None
    decode = _k.paged_decode_attention

    def paged_decode_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len,
                               softmax_scale, alibi_slopes, out, kv_layout, k_scale=None, k_zero=None, v_scale=None,
                               v_zero=None, sliding_window=0, logit_softcapping=0.0):
        decode(query, key_cache, value_cache, block_table, cu_seqlens_q, kv_seq_len, max_kv_seq_len, softmax_scale,
               alibi_slopes, out, k_scale, v_scale, v_zero, k_zero, sliding_window, logit_softcapping)

    return paged_decode_attention


def weight_quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, offset: Optional[Tensor], bias: Optional[Tensor],
                        group_size: int) -> Optional[Callable]:
    if w4_layouts.is_k_interleaved(qweight):
        if not (weight_quant.integer_kernel_takes(group_size) and qweight.is_contiguous()):
            return None
        matmul = _k.w4_matmul_k_interleaved
        path = weight_quant.k_interleaved_path(x)  # the setting, read once per call site
        if path is None:
            return None  # the op function's dequantise + BLAS

        def weight_quant_matmul_k_interleaved(x, qweight, scale, offset, bias, group_size):
            return matmul(x, qweight, scale, offset, bias, group_size, path)

        return weight_quant_matmul_k_interleaved
    if x.shape[0] > weight_quant.GEMV_MAX_ROWS:
        return None
    return _k.w4_matmul


BINDINGS = {
    "linear": linear,
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rms_norm_w8a8": rms_norm_w8a8,
    "add_rms_norm_w8a8": add_rms_norm_w8a8,
    "apply_rotary_pos_emb": apply_rotary_pos_emb,
    "silu_and_mul": silu_and_mul,
    "fill_kv_cache": fill_kv_cache,
    "paged_decode_attention": paged_decode_attention,
    "weight_quant_matmul": weight_quant_matmul,
}
