"""Stand-in (layout demonstration) for the device hook, declared in pyproject.toml under the
entry-point group `dlinfer.lmdeploy_devices`. dlinfer.framework.lmdeploy_ext.device calls it when
LMDeploy initialises device_type "ascend" (`AscendOpsBackend.init`, ascend/op_backend.py). A real package applies its
device-specific setup here (model patches, torch.compile settings, ...)."""

from dlinfer.vendor.ascend import CALLS


def init_device(device_type: str) -> str:
    CALLS["init_device:" + device_type] += 1
    return "stand-in ascend device initialised"
