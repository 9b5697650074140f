"""Imported by LMDeploy to initialise one of its own dlinfer device types; hands that to the
vendor package that provides it.

LMDeploy 0.18's `AscendOpsBackend.init()` runs `import dlinfer.framework.lmdeploy_ext.device`
(lmdeploy/pytorch/backends/dlinfer/ascend/op_backend.py). Importing this module calls
`devices.hooks.init_device(devices.hooks.current_device_type())`: the `init_device` callable the
installed vendor package declares under the entry-point group `dlinfer.lmdeploy_devices` for that
device type ("ascend" unless LMDeploy's current device context names maca or camb). Without such a
package the import raises `devices.hooks.DeviceModuleNotFound`, naming the device type and the
package it needs. To initialise a device type explicitly, call `devices.hooks.init_device` instead
of importing this module.
"""

from __future__ import annotations

from dlinfer.framework.lmdeploy_ext.devices.hooks import (
    DeviceModuleNotFound,
    current_device_type,
    init_device,
)

DEVICE_TYPE = current_device_type()
init_device(DEVICE_TYPE)

__all__ = ["DEVICE_TYPE", "DeviceModuleNotFound", "init_device"]
