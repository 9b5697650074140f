"""Stand-in (layout demonstration). LMDeploy 0.18's ascend backend imports from here
`AscendGraphRunner` (in `AscendOpsBackend.build_graph_runner`, built as AscendGraphRunner(model, model_config,
cache_config, backend_config, device, is_mla=...)) and `get_ascend_compatible_size`
(in `AscendOpsBackend.update_step_context`, the batch size a decode graph is captured for). The stand-in runner
runs the model eagerly; a real package captures ACL graphs."""

import torch
from lmdeploy.pytorch.backends.graph_runner import GraphRunner

from dlinfer.vendor.ascend import CALLS

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def get_ascend_compatible_size(n: int) -> int:
    """Smallest captured batch size >= n (n itself beyond the largest)."""
    CALLS["get_ascend_compatible_size"] += 1
    return next((s for s in CAPTURE_SIZES if s >= n), n)


class AscendGraphRunner(GraphRunner):
    def __init__(self, model: torch.nn.Module, model_config, cache_config, backend_config, device,
                 is_mla: bool = False):
        CALLS["AscendGraphRunner"] += 1
        super().__init__(model, model_config, cache_config, backend_config, device)
        self.is_mla = is_mla
