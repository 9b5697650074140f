"""DeepSeek's per-head latent products in graph mode (written against LMDeploy 0.18.0).

Why: `DeepseekV2BMM.forward` (models/deepseek_v2.py), the per-head product of MLA's absorbed
query and value projections, writes with `torch.bmm(..., out=output.transpose(0, 1))`: an `out=`
tensor that is not contiguous, which Dynamo refuses to trace ("Attempted to call op with
non-contiguous `out=` tensor"), so a DeepSeek decode step could not be compiled by dlinfer's
graph mode and every step ran eagerly.

How: while torch.compile traces (only then), the product is computed into a new tensor and
copied into `output`, the same values; eager calls, on every device, keep LMDeploy's `out=` form.
"""

from __future__ import annotations

import functools

import torch

from dlinfer.framework.lmdeploy_ext.patching import wrap


def _patch_forward(original):

    @functools.wraps(original)
    def forward(self, x: torch.Tensor, output: torch.Tensor):
        if not torch.compiler.is_compiling():
            return original(self, x, output)
        output.transpose(0, 1).copy_(torch.bmm(x.transpose(0, 1), self.weight))

    return forward


def apply() -> None:
    from lmdeploy.pytorch.models.deepseek_v2 import DeepseekV2BMM

    wrap(DeepseekV2BMM, "forward", _patch_forward)
