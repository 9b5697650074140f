"""Stand-in (layout demonstration). LMDeploy 0.18 calls `init_device_properties_triton()` at the end
of AscendOpsBackend.init() (ascend/op_backend.py); an ImportError there is logged as
"triton-ascend is not installed". A real package reads the NPU's properties for its Triton kernels."""

from dlinfer.vendor.ascend import CALLS


def init_device_properties_triton() -> None:
    CALLS["init_device_properties_triton"] += 1
