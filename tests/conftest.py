"""Suite-wide settings. Runs before any test module imports dlinfer or triton."""

import os

# Value checks (slots inside the cache, lengths inside the block table) are on for the whole suite.
os.environ["DLINFER_CHECK_VALUES"] = "1"

# Ray (tests/lmdeploy/test_ray_executor.py): every node on the loopback address (read once, when
# Ray is imported: so here, before any test imports it), no usage reports, no token (a cluster no
# other machine can reach needs none, and Ray would otherwise write one to ~/.ray), and a node that
# gets SIGTERM stops at once (Ray's drain, for Serve replicas these clusters never run, otherwise
# waited its full 30 s at every stop).
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                  RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")

import torch  # noqa: E402

# No GPU: Triton kernels run through the interpreter (small shapes only, see tests/ops/cases.py and
# dlinfer/conformance).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
