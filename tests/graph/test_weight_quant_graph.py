"""weight_quant_matmul under torch.compile: one dlinfer node, as LMDeploy's awq_linear calls it."""

import torch

import dlinfer.ops as ops
from dlinfer.conformance.suites import weight_quant

from .helpers import capture, dl_counts


def test_graph_mode_one_node():
    """Under torch.compile (fullgraph) the op is one torch.ops.dlinfer node, as LMDeploy calls it
    (x [1, T, K] squeezed, the result unsqueezed)."""
    case = weight_quant.W4Case("graph", (3,), 64, 48, 32, bias=True)
    qweight, scale, offset, bias = weight_quant.weights(case, torch.float32, torch.Generator().manual_seed(0))

    def awq_linear(x):
        return ops.weight_quant_matmul(x.squeeze(0), qweight, scale, offset=offset, bias=bias, all_reduce=False,
                                       group_size=32).unsqueeze(0)

    x = torch.randn(1, 3, 64)
    gm, _ = capture(awq_linear, x)
    assert dl_counts(gm) == {"weight_quant_matmul": 1}
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(awq_linear, backend="dlinfer", fullgraph=True)(x), awq_linear(x))
