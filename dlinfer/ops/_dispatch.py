"""How a validated public op reaches its kernel: the vendor function in eager mode, the
`torch.ops.dlinfer` custom op while torch.compile traces (one graph node per op)."""

from __future__ import annotations

import copy
from typing import Callable, Tuple

import torch

from dlinfer.errors import UnsupportedError
from dlinfer.vendor import registry
from dlinfer.vendor.base import Vendor
from dlinfer.vendor.selection import resolve


def _constant_result(fn: Callable) -> Callable:
    """`torch.compiler.assume_constant_result` without its `import torch._dynamo`: that import
    (Dynamo, sympy, Triton: ~1.4 s) would otherwise come with `import dlinfer.ops` in every process,
    eager ones included, which never trace. In torch 2.13 the decorator only marks the function
    (torch/_dynamo/decorators.py); tests/test_layers.py checks that the mark set here is the
    one torch's decorator sets, and tests/graph/test_backend.py that a process's first op call
    compiles with fullgraph (without the mark Dynamo meets the vendor's loading and fails)."""
    fn._dynamo_marked_constant = True
    return fn


class _Tracing:
    # Dynamo cannot trace a vendor's first load (importlib): with fullgraph=True, a model whose
    # first op call is compiled would fail. While tracing, the vendor is read once, as a constant
    # (the kernel itself is still resolved when the custom op runs). Two Dynamo 2.13 bugs shape
    # this: an assume_constant_result function must be reached through a class attribute (as a
    # plain global of another module it is mis-guarded), and it must return a copy (the vendor
    # object also reached through the registry gets an identity guard naming a missing source).
    @staticmethod
    @_constant_result
    def vendor(op: str, device_type: str) -> Vendor:
        return copy.copy(resolve(op, device_type)[1])

    # Membership in the vendor copy's frozenset of features fails to guard (Dynamo 2.13: a
    # constant source has no guard): the answer is read as a constant too.
    @staticmethod
    @_constant_result
    def supports(vendor_name: str, feature: str) -> bool:
        return registry.load(vendor_name).supports(feature)


def kernel_for(op: str, device: torch.device) -> Tuple[Callable, Vendor]:
    """(what to call with the canonical arguments, the vendor behind it) for `op` on `device`.

    Eagerly that is the vendor's function itself (after any fallback to torch); while
    torch.compile traces it is `torch.ops.dlinfer.<op>`, so the op becomes one graph node.
    """
    device_type = device.type
    if torch.compiler.is_compiling():
        fn, vendor = getattr(torch.ops.dlinfer, op), _Tracing.vendor(op, device_type)
    else:
        fn, vendor = resolve(op, device_type)
    if device_type not in vendor.device_types and "*" not in vendor.device_types:
        raise UnsupportedError(vendor.name, op, f"tensors on device type {device_type!r}")
    return fn, vendor


def require(vendor: Vendor, op: str, feature: str) -> None:
    ok = _Tracing.supports(vendor.name, feature) if torch.compiler.is_compiling() else vendor.supports(feature)
    if not ok:
        raise UnsupportedError(vendor.name, op, feature)


def check_dtype(vendor: Vendor, op: str, dtype: torch.dtype) -> None:
    if dtype not in vendor.capabilities.dtypes:
        raise UnsupportedError(vendor.name, op, f"dtype {dtype}")


def check_head_dim(vendor: Vendor, op: str, head_dim: int) -> None:
    dims = vendor.capabilities.head_dims
    if dims is not None and head_dim not in dims:
        raise UnsupportedError(vendor.name, op, f"head dim {head_dim} (supported: {dims})")


def int_arg(value):
    """An integer argument its check accepted (a Python int or a one-element integer tensor, as
    `_checks.integer` takes it), as the int the kernel is called with. In the op body, which Dynamo
    traces: not among the checks."""
    return int(value.item()) if isinstance(value, torch.Tensor) else value
