"""Stand-in (layout demonstration). LMDeploy 0.18 calls `ensure_ascend_runtime()` first in
AscendOpsBackend.init() (ascend/op_backend.py). A real package checks the CANN toolkit /
torch_npu versions here and raises with a clear message when they do not fit."""

from dlinfer.vendor.ascend import CALLS


def ensure_ascend_runtime() -> None:
    CALLS["ensure_ascend_runtime"] += 1
