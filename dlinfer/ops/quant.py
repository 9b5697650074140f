"""W8A8: dynamic per-token int8 quantisation, the int8 linear, and RMSNorm fused with the quantisation.

int8 symmetric throughout: activations get one float32 scale per token (row), weights one per
output channel. `scale = amax(|x|) / 127` (float32), `xq = clamp(round(x / scale), -128, 127)` with
round half to even; a zero row gives xq 0 and scale 0. The int8 product is exact (int32).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from dlinfer.ops import _checks as C
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, kernel_for
from dlinfer.ops.norm import _check_common, _rows

INT8 = (torch.int8,)
F32 = (torch.float32,)


def _check_quant_dtype(op: str, quant_dtype) -> None:
    if quant_dtype is not torch.int8:
        raise C.InvalidArgumentError(op, "quant_dtype", "torch.int8 (the only quantised dtype)",
                                     C.describe(quant_dtype))


def _split_quant(out: Tuple[Tensor, Tensor], shape) -> Tuple[Tensor, Tensor]:
    xq, scale = out
    if len(shape) == 2:
        return xq, scale
    return xq.view(shape), scale.view(shape[:-1])


def dynamic_quant(x: Tensor, quant_dtype: torch.dtype = torch.int8,
                  quant_granularity: str = "PER_TOKEN") -> Tuple[Tensor, Tensor]:
    """Per-token symmetric int8 quantisation.

    x: [..., K] float32/float16/bfloat16, not modified.
    quant_dtype: torch.int8 only.  quant_granularity: "PER_TOKEN" only.
    Returns new tensors (xq [..., K] int8, scale x.shape[:-1] float32), x ~= xq * scale[..., None].
    A row holding a NaN gets scale NaN, so the next linear_w8a8 row is NaN too (its codes are not
    specified: the cpu and triton vendors write 0); the same holds for the fused norm forms below.
    """
    kernel = (_check_dynamic_quant(x, quant_dtype, quant_granularity) if not torch.compiler.is_compiling()
              else checked("dynamic_quant", _check_dynamic_quant, x, quant_dtype, quant_granularity))
    return _split_quant(kernel(_rows(x, x.shape[-1])), x.shape)


def _check_dynamic_quant(x, quant_dtype, quant_granularity):
    """Checks dynamic_quant's arguments; returns the vendor's function (`kernel_for`)."""
    op = "dynamic_quant"
    C.rank_at_least(op, "x", x, 1, "[..., K]")
    C.dtype_in(op, "x", x, C.FLOAT_DTYPES)
    _check_quant_dtype(op, quant_dtype)
    if quant_granularity != "PER_TOKEN":
        raise C.InvalidArgumentError(op, "quant_granularity", "'PER_TOKEN' (the only granularity)",
                                     C.describe(quant_granularity))
    kernel, vendor = kernel_for(op, x.device)
    check_dtype(vendor, op, x.dtype)
    return kernel


def linear_w8a8(a: Tensor, b: Tensor, rms_scale: Tensor, linear_scale: Tensor, out_dtype: torch.dtype,
                quant_dtype: torch.dtype = torch.int8, bias: Optional[Tensor] = None) -> Tensor:
    """(a @ b.T, accumulated exactly in int32) * rms_scale[..., None] * linear_scale (+ bias).

    a: [..., K] int8 (quantised activations).  b: [N, K] int8 (quantised weight), same device.
    rms_scale: float32, a.shape[:-1] or a.shape[:-1] + (1,) (per-token scales).
    linear_scale: float32 [N] or [N, 1] (per-output-channel scales).
    out_dtype: float32/float16/bfloat16.  quant_dtype: torch.int8 only.
    bias: [N] float32/float16/bfloat16 or None.
    Returns a new tensor [..., N] in out_dtype (the scaling in float32, one final rounding).
    """
    args = (a, b, rms_scale, linear_scale, out_dtype, quant_dtype, bias)
    kernel = (_check_linear_w8a8(*args) if not torch.compiler.is_compiling()
              else checked("linear_w8a8", _check_linear_w8a8, *args))
    if a.dim() == 2:
        return kernel(a, b, rms_scale.reshape(a.shape[0]), linear_scale, out_dtype, bias)
    lead = a.shape[:-1]
    rows = math.prod(lead)
    # linear_scale as LMDeploy holds it ([N] or [N, 1]): a reshape here would be one more call per
    # linear and step in a replayed graph (docs/benchmarks.md, "Kernel calls without the dispatcher").
    out = kernel(a.reshape(rows, a.shape[-1]), b, rms_scale.reshape(rows), linear_scale, out_dtype, bias)
    return out.view(*lead, b.shape[0])


def _check_linear_w8a8(a, b, rms_scale, linear_scale, out_dtype, quant_dtype, bias):
    """Checks linear_w8a8's arguments; returns the vendor's function (`kernel_for`)."""
    op = "linear_w8a8"
    C.rank_at_least(op, "a", a, 1, "[..., K]")
    C.dtype_in(op, "a", a, INT8)
    k = a.shape[-1]
    device = a.device
    C.tensor(op, "b", b, ("N", k), INT8, device)
    n = b.shape[0]
    lead = tuple(a.shape[:-1])
    if not isinstance(rms_scale, Tensor) or tuple(rms_scale.shape) not in (lead, lead + (1,)):
        raise C.InvalidArgumentError(op, "rms_scale", f"a tensor {list(lead)} or {list(lead + (1,))}",
                                     C.describe(rms_scale))
    C.dtype_in(op, "rms_scale", rms_scale, F32)
    if rms_scale.device != device:
        raise C.InvalidArgumentError(op, "rms_scale", f"device {device}", C.describe(rms_scale))
    if not isinstance(linear_scale, Tensor) or tuple(linear_scale.shape) not in ((n,), (n, 1)):
        raise C.InvalidArgumentError(op, "linear_scale", f"a tensor [{n}] or [{n}, 1]", C.describe(linear_scale))
    C.dtype_in(op, "linear_scale", linear_scale, F32)
    if linear_scale.device != device:
        raise C.InvalidArgumentError(op, "linear_scale", f"device {device}", C.describe(linear_scale))
    if out_dtype not in C.FLOAT_DTYPES:
        raise C.InvalidArgumentError(op, "out_dtype", "float32/float16/bfloat16", C.describe(out_dtype))
    _check_quant_dtype(op, quant_dtype)
    if bias is not None:
        C.tensor(op, "bias", bias, (n,), C.FLOAT_DTYPES, device)
    kernel, vendor = kernel_for(op, device)
    check_dtype(vendor, op, out_dtype)
    return kernel


def rms_norm_w8a8(hidden_states: Tensor, weight: Tensor, epsilon: float,
                  quant_dtype: torch.dtype = torch.int8) -> Tuple[Tensor, Tensor]:
    """dynamic_quant(rms_norm(hidden_states, weight, epsilon)), the norm rounded to h's dtype first.

    hidden_states: [..., H] float32/float16/bfloat16, not modified.  weight: [H] float, same device.
    quant_dtype: torch.int8 only.
    Returns new tensors (xq [..., H] int8, scale hidden_states.shape[:-1] float32).
    """
    kernel = (_check_rms_norm_w8a8(hidden_states, weight, epsilon, quant_dtype) if not torch.compiler.is_compiling()
              else checked("rms_norm_w8a8", _check_rms_norm_w8a8, hidden_states, weight, epsilon, quant_dtype))
    out = kernel(_rows(hidden_states, hidden_states.shape[-1]), weight, float(epsilon))
    return _split_quant(out, hidden_states.shape)


def _check_rms_norm_w8a8(hidden_states, weight, epsilon, quant_dtype):
    op = "rms_norm_w8a8"
    kernel = _check_common(op, hidden_states, weight, epsilon)
    _check_quant_dtype(op, quant_dtype)
    return kernel


def add_rms_norm_w8a8(hidden_states: Tensor, residual: Tensor, weight: Tensor, epsilon: float,
                      quant_dtype: torch.dtype = torch.int8) -> Tuple[Tensor, Tensor, Tensor]:
    """Residual add, RMSNorm and per-token int8 quantisation.

    hidden_states, residual: [..., H], same shape, dtype and device; not modified.  weight: [H].
    quant_dtype: torch.int8 only.
    Returns new tensors (xq [..., H] int8, scale [...] float32, hidden_states + residual [..., H]),
    xq/scale quantising rms_norm(h + r) (the sum rounded to the activation dtype, as is the norm).
    """
    args = (hidden_states, residual, weight, epsilon, quant_dtype)
    kernel = (_check_add_rms_norm_w8a8(*args) if not torch.compiler.is_compiling()
              else checked("add_rms_norm_w8a8", _check_add_rms_norm_w8a8, *args))
    hidden = hidden_states.shape[-1]
    xq, scale, added = kernel(_rows(hidden_states, hidden), _rows(residual, hidden), weight, float(epsilon))
    if hidden_states.dim() == 2:
        return xq, scale, added
    shape = hidden_states.shape
    return xq.view(shape), scale.view(shape[:-1]), added.view(shape)


def _check_add_rms_norm_w8a8(hidden_states, residual, weight, epsilon, quant_dtype):
    op = "add_rms_norm_w8a8"
    kernel = _check_common(op, hidden_states, weight, epsilon)
    C.tensor(op, "residual", residual, tuple(hidden_states.shape), C.FLOAT_DTYPES, hidden_states.device)
    C.same_dtype(op, "residual", residual, hidden_states, "hidden_states")
    _check_quant_dtype(op, quant_dtype)
    return kernel


def _check_single_value(op: str, name: str, t, dtypes, device) -> None:
    """t: one value for the layer, a tensor [1] (or a 0-d one) of `dtypes` on `device`."""
    if not isinstance(t, Tensor) or t.numel() != 1 or t.dim() > 1:
        raise C.InvalidArgumentError(op, name, "a tensor [1] (one value for the layer)", C.describe(t))
    C.dtype_in(op, name, t, dtypes)
    if t.device != device:
        raise C.InvalidArgumentError(op, name, f"device {device}", C.describe(t))


def _check_linear_w8a8_static(x, weight, input_scale, input_offset, deq_scale, out_dtype, quant_dtype, quant_bias):
    """Checks linear_w8a8_static's arguments (metadata only); returns the vendor's function."""
    op = "linear_w8a8_static"
    C.rank_at_least(op, "x", x, 1, "[..., K]")
    C.dtype_in(op, "x", x, C.FLOAT_DTYPES)
    k, device = x.shape[-1], x.device
    C.tensor(op, "weight", weight, ("N", k), INT8, device)
    n = weight.shape[0]
    _check_single_value(op, "input_scale", input_scale, C.FLOAT_DTYPES, device)
    _check_single_value(op, "input_offset", input_offset, INT8 + C.FLOAT_DTYPES, device)
    C.tensor(op, "deq_scale", deq_scale, (n,), F32, device)
    if out_dtype not in C.FLOAT_DTYPES:
        raise C.InvalidArgumentError(op, "out_dtype", "float32/float16/bfloat16", C.describe(out_dtype))
    _check_quant_dtype(op, quant_dtype)
    if quant_bias is not None:
        C.tensor(op, "quant_bias", quant_bias, (n,), (torch.int32,), device)
    kernel, vendor = kernel_for(op, device)
    check_dtype(vendor, op, out_dtype)
    return kernel


def linear_w8a8_static(x: Tensor, weight: Tensor, input_scale: Tensor, input_offset: Tensor, deq_scale: Tensor,
                       out_dtype: torch.dtype, quant_dtype: torch.dtype = torch.int8,
                       quant_bias: Optional[Tensor] = None) -> Tensor:
    """ModelSlim static W8A8 linear (LMDeploy's `W8A8Linear` ModelSlim parameters, nn/linear/w8a8.py).

    x: [..., K] float32/float16/bfloat16 activations, not modified.
    weight: [N, K] int8.  input_scale: [1] float (the model dtype), the layer's static activation
    scale.  input_offset: [1] int8 (or float), its zero point.  deq_scale: [N] float32.
    out_dtype: float32/float16/bfloat16.  quant_dtype: torch.int8 only.
    quant_bias: [N] int32 or None (the integer bias ModelSlim folds the offset's correction into).
    Returns a new [..., N] tensor in out_dtype:
        xq = clamp(round_half_even(x_f32 / input_scale + input_offset), -128, 127)  (float32 steps)
        out = float32(xq @ weight.T + quant_bias) * deq_scale   (the integer sum exact)
    """
    args = (x, weight, input_scale, input_offset, deq_scale, out_dtype, quant_dtype, quant_bias)
    kernel = (_check_linear_w8a8_static(*args) if not torch.compiler.is_compiling()
              else checked("linear_w8a8_static", _check_linear_w8a8_static, *args))
    scale, offset = input_scale.reshape(1).to(torch.float32), input_offset.reshape(1).to(torch.float32)
    if C.check_values_enabled() and (not bool(torch.isfinite(scale).all()) or float(scale) <= 0):
        raise C.InvalidArgumentError("linear_w8a8_static", "input_scale", "a finite scale > 0", str(scale.tolist()))
    k, n = x.shape[-1], weight.shape[0]
    if x.dim() == 2:
        return kernel(x, weight, scale, offset, deq_scale, out_dtype, quant_bias)
    lead = tuple(x.shape[:-1])
    out = kernel(x.reshape(math.prod(lead), k), weight, scale, offset, deq_scale, out_dtype, quant_bias)
    return out.view(*lead, n)
