"""Vendor registry and selection.

    dlinfer.vendor.use("triton")                 # every op through the triton vendor
    with dlinfer.vendor.using("torch", kv_layout="head_major"): ...
    dlinfer.vendor.vendor_name                   # name of the active vendor (LMDeploy reads it)
    dlinfer.vendor.available()                   # vendors that load here

Environment: DLINFER_VENDOR=<name>, DLINFER_KV_LAYOUT=token_major|head_major,
DLINFER_FALLBACK_OPS=op,op|all (run those ops on the torch vendor).
"""

from pkgutil import extend_path

# Open to other distributions: a vendor package may add dlinfer.vendor.<name> (e.g. the modules
# LMDeploy 0.18 imports for its ascend device type; docs/vendors.md).
__path__ = extend_path(__path__, __name__)

from dlinfer.vendor.base import HEAD_MAJOR, KV_LAYOUTS, OP_NAMES, TOKEN_MAJOR, Capabilities, Vendor
from dlinfer.vendor.registry import available, failures, known_names, load
from dlinfer.vendor.selection import current, kv_layout, reset, resolve, use, using

__all__ = [
    "Vendor", "Capabilities", "TOKEN_MAJOR", "HEAD_MAJOR", "KV_LAYOUTS", "OP_NAMES",
    "available", "failures", "known_names", "load",
    "current", "kv_layout", "reset", "resolve", "use", "using",
]


def __getattr__(attr):
    # `vendor_name` is computed on access so it always names the active vendor, including for
    # `from dlinfer.vendor import vendor_name` (which LMDeploy 0.18 does when building MoE layers).
    if attr == "vendor_name":
        return current().name
    raise AttributeError(f"module 'dlinfer.vendor' has no attribute {attr!r}")
