"""dlinfer's adaptor for LMDeploy 0.18.x: importing this package patches LMDeploy, once.

    import dlinfer.framework.lmdeploy_ext  # noqa: F401  (before building the engine config)
    from lmdeploy import pipeline, PytorchEngineConfig
    pipe = pipeline(model_dir, backend_config=PytorchEngineConfig(device_type="cpu"))

It adds the device types of `devices/specs.py` ("cpu"; "dlinfer_cuda", not yet run on a GPU), whose
ops backend (`backend/`) subclasses LMDeploy's own `DlinferOpsBackend`, so LMDeploy's dlinfer
layers and `kernels/dlinfer` wrappers run unchanged on `dlinfer.ops`. The patches themselves,
one module each, are listed in `patches/__init__.py`; they change nothing for LMDeploy's own
device types. Another LMDeploy version is refused (`version.py`) before anything is patched.
Importing twice, or reloading, patches nothing twice.
"""

from __future__ import annotations

from pkgutil import extend_path

# The module paths LMDeploy 0.18 imports from dlinfer itself by name (a vendor package adds the
# others: `dlinfer.vendor.<device>...`, `cudagraph.<device>_cudagraph`). They stay where they are
# whatever else moves; tests/lmdeploy/test_lmdeploy_device_modules.py reads LMDeploy's source and
# checks this list.
LMDEPLOY_IMPORTED_MODULES = (
    "dlinfer.framework.lmdeploy_ext",  # lmdeploy.utils.try_import_deeplink: applies the patches
    "dlinfer.framework.lmdeploy_ext.device",  # AscendOpsBackend.init: hands over to a package's hook
    "dlinfer.framework.lmdeploy_ext.cudagraph",  # the package a vendor's <device>_cudagraph joins
    "dlinfer.ops",  # kernels/dlinfer: every op
    "dlinfer.utils.type_annotation",  # kernels/dlinfer: MoECommType, MoeMetadata
    "dlinfer.vendor",  # backends/dlinfer/moe.py: vendor_name
)

# Open to vendor packages, which add the modules LMDeploy imports for its own device types
# (`cudagraph.ascend_cudagraph`, ...; docs/vendors.md). `device.py` hands those devices over.
__path__ = extend_path(__path__, __name__)

from dlinfer.framework.lmdeploy_ext.version import (  # noqa: E402
    UnsupportedLMDeployVersion,
    check_lmdeploy_version,
    installed_lmdeploy_version,
)

check_lmdeploy_version(installed_lmdeploy_version())

from dlinfer.framework.lmdeploy_ext.backend.model_support import UnsupportedModelError  # noqa: E402
from dlinfer.framework.lmdeploy_ext.devices import DEVICES  # noqa: E402
from dlinfer.framework.lmdeploy_ext.patches import apply_all as _apply_all  # noqa: E402

_apply_all()

__all__ = ["DEVICES", "UnsupportedLMDeployVersion", "UnsupportedModelError"]
