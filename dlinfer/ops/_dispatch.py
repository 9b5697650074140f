"""How a validated public op reaches its kernel: the vendor function in eager mode, the
`torch.ops.dlinfer` custom op while torch.compile traces (one graph node per op)."""

from __future__ import annotations

import torch

from dlinfer.errors import UnsupportedError
from dlinfer.vendor.base import Vendor
from dlinfer.vendor.selection import resolve


def vendor_for(op: str, device: torch.device) -> Vendor:
    """The vendor that will run `op` on `device` (after any fallback to torch)."""
    fn, vendor = resolve(op, device.type)
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
