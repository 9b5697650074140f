"""How a validated public op reaches its kernel: the vendor function in eager mode, the
`torch.ops.dlinfer` custom op while torch.compile traces (one graph node per op)."""

from __future__ import annotations

import copy

import torch

from dlinfer.errors import UnsupportedError
from dlinfer.vendor.base import Vendor
from dlinfer.vendor.selection import resolve


class _Tracing:
    # Dynamo cannot trace a vendor's first load (importlib): with fullgraph=True, a model whose
    # first op call is compiled would fail. While tracing, the vendor is read once, as a constant
    # (the kernel itself is still resolved when the custom op runs). Two Dynamo 2.13 bugs shape
    # this: an assume_constant_result function must be reached through a class attribute (as a
    # plain global of another module it is mis-guarded), and it must return a copy (the vendor
    # object also reached through the registry gets an identity guard naming a missing source).
    @staticmethod
    @torch.compiler.assume_constant_result
    def vendor(op: str, device_type: str) -> Vendor:
        return copy.copy(resolve(op, device_type)[1])


def vendor_for(op: str, device: torch.device) -> Vendor:
    """The vendor that will run `op` on `device` (after any fallback to torch)."""
    vendor = _Tracing.vendor(op, device.type) if torch.compiler.is_compiling() else resolve(op, device.type)[1]
    if "*" not in vendor.device_types and device.type not in vendor.device_types:
        raise UnsupportedError(vendor.name, op, f"tensors on device type {device.type!r}")
    return vendor


def require(vendor: Vendor, op: str, feature: str) -> None:
    if not vendor.supports(feature):
        raise UnsupportedError(vendor.name, op, feature)


def check_dtype(vendor: Vendor, op: str, dtype: torch.dtype) -> None:
    if dtype not in vendor.capabilities.dtypes:
        raise UnsupportedError(vendor.name, op, f"dtype {dtype}")


def check_head_dim(vendor: Vendor, op: str, head_dim: int) -> None:
    dims = vendor.capabilities.head_dims
    if dims is not None and head_dim not in dims:
        raise UnsupportedError(vendor.name, op, f"head dim {head_dim} (supported: {dims})")


def run(op: str, device: torch.device, *args):
    if torch.compiler.is_compiling():
        return getattr(torch.ops.dlinfer, op)(*args)
    return resolve(op, device.type)[0](*args)
