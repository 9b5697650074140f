"""Device initialisation for LMDeploy's own device types, handed to vendor packages.

dlinfer implements none of LMDeploy's own dlinfer device types (ascend, maca, camb); a chip
vendor's package does. When LMDeploy initialises such a device it imports
`dlinfer.framework.lmdeploy_ext.device` (LMDeploy 0.18: only `AscendOpsBackend.init()`,
lmdeploy/pytorch/backends/dlinfer/ascend/op_backend.py), which calls `init_device` here.

The hook: a vendor package declares, in its pyproject.toml,

    [project.entry-points."dlinfer.lmdeploy_devices"]
    ascend = "mychip_pkg.device:init_device"

naming a callable `init_device(device_type: str) -> None` for each LMDeploy device type it serves.
`init_device(device_type)` loads and calls it, once per device type per process (a call that
raised is retried next time). Where no installed package declares the device type it raises
`DeviceModuleNotFound`, naming the device type, the entry-point group and the package LMDeploy
expects (`dlinfer.vendor.<device type>`). That error is a `VendorError` (a RuntimeError, not an
ImportError) on purpose: LMDeploy logs an ImportError from this import as "dlinfer framework
extensions not found", but any other exception with its message.

dlinfer's own device types (`devices.DEVICES`: "cpu", "dlinfer_cuda") and "cuda" need no hook:
`init_device` returns None for them.
"""

from __future__ import annotations

import importlib.metadata
import threading
from typing import Callable

from dlinfer.errors import VendorError

ENTRY_POINT_GROUP = "dlinfer.lmdeploy_devices"
# LMDeploy 0.18's device types that run through dlinfer (`lmdeploy.utils.try_import_deeplink`
# also lists "npu", which LMDeploy's backend selector does not accept).
LMDEPLOY_DLINFER_DEVICE_TYPES = ("ascend", "maca", "camb")
# What the vendor package for each one is called in messages.
CHIPS = {"ascend": "Huawei Ascend", "maca": "MetaX", "camb": "Cambricon"}

_done: dict[str, object] = {}
_lock = threading.Lock()


class DeviceModuleNotFound(VendorError):
    """No installed package provides the device initialisation for an LMDeploy device type."""


def providers() -> dict[str, importlib.metadata.EntryPoint]:
    """LMDeploy device type -> the entry point an installed package declares for it."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _missing(device_type: str, found: dict) -> DeviceModuleNotFound:
    chip = CHIPS.get(device_type, device_type)
    declared = ", ".join(sorted(found)) or "none"
    return DeviceModuleNotFound(
        f"no installed package provides LMDeploy device type {device_type!r}: install the {chip} "
        f"vendor package for dlinfer (the one providing the package dlinfer.vendor.{device_type}); "
        f"dlinfer found no entry point {device_type!r} in the group {ENTRY_POINT_GROUP!r} "
        f"(device types declared there: {declared}). See dlinfer's docs/vendors.md."
    )


def init_device(device_type: str):
    """Run the installed vendor package's device initialisation for `device_type`, once per
    process, and return what it returned (None for cuda and dlinfer's own device types)."""
    from dlinfer.framework.lmdeploy_ext.devices import DEVICES

    if device_type == "cuda" or device_type in DEVICES:
        return None
    with _lock:
        if device_type in _done:
            return _done[device_type]
        found = providers()
        if device_type not in found:
            raise _missing(device_type, found)
        hook: Callable[[str], object] = found[device_type].load()
        result = _done[device_type] = hook(device_type)
        return result


def current_device_type(default: str = "ascend") -> str:
    """The LMDeploy device type being initialised: that of LMDeploy's current device context when
    it is one of LMDeploy's dlinfer device types, else `default` ("ascend", the one LMDeploy 0.18
    backend that imports `device`; `init_backend` leaves the device context before `init()`)."""
    from lmdeploy.pytorch.devices import get_device_manager

    device_type = get_device_manager().current_context().device_type
    return device_type if device_type in LMDEPLOY_DLINFER_DEVICE_TYPES else default
