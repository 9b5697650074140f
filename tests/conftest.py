"""Suite-wide settings. Runs before any test module imports dlinfer or triton."""

import os

# Value checks (slots inside the cache, lengths inside the block table) are on for the whole suite.
os.environ["DLINFER_CHECK_VALUES"] = "1"

import torch  # noqa: E402

# No GPU: Triton kernels run through the interpreter (small shapes only, see tests/ops/cases.py and
# dlinfer/conformance).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
