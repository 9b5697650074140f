"""The device types of the LMDeploy adaptor.

- `specs.py`: the device types dlinfer adds to LMDeploy ("cpu", "dlinfer_cuda"), what each accepts
  and defaults to (`DeviceSpec`), and the engine-device context the patches consult. Its names are
  re-exported here: `devices.spec_for(...)`, `devices.CPU`.
- `hooks.py`: LMDeploy's own dlinfer device types (ascend, maca, camb), which out-of-tree vendor
  packages serve: their device hooks, found by entry point and run once.

`dlinfer.framework.lmdeploy_ext.device` (beside this package) is the module LMDeploy itself imports
for those device types (`LMDEPLOY_IMPORTED_MODULES` in the adaptor's `__init__`): it stays at that
path and hands over to `hooks.py`.
"""

from dlinfer.framework.lmdeploy_ext.devices.specs import (  # noqa: F401
    CPU,
    DEVICES,
    DLINFER_CUDA,
    DeviceSpec,
    engine_device,
    engine_device_scope,
    spec_for,
)
