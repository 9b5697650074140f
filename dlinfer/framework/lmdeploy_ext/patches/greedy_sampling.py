"""Greedy sampling's argmax on CPU logits as `max(-1).indices` (written against LMDeploy 0.18.0).

Why: when every request of a batch samples greedily (`sampling_inputs.max_top_k == 1`),
`FusedLogitsProcessor.sampling` (engine/logits_process.py) returns `logits.argmax(-1)`. On the
CPU, torch 2.13's argmax over bfloat16 has no vectorised path: 428 us for one row of a
128256-token vocabulary and 1.75 ms for eight (Zen 5 VM, 2 threads), where `logits.max(-1)`
takes 81 and 294 us (float32: 97 -> 66 us); SmolLM2's 49152 tokens: 164 -> 30 us. That was a
sixth of LMDeploy's engine time around a Llama-3.2-1B-shaped bf16 decode step
(docs/notes/decode-step-overheads.md).

How: for logits on the CPU (only dlinfer's cpu device type puts them there) with max_top_k == 1
the wrapper returns `logits.max(-1).indices`: the same int64 indices, as torch defines both (the
first maximal value; a NaN counts as maximal, its first index is returned), checked against
argmax on ties, NaN and infinities in tests/lmdeploy/test_greedy_sampling.py. Any other case
runs LMDeploy's sampling unchanged.
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext.patching import wrap


def _patch_sampling(original):

    @functools.wraps(original)
    def sampling(self, logits):
        if logits.device.type == "cpu" and self.sampling_inputs.max_top_k == 1:
            return logits.max(-1).indices
        return original(self, logits)

    return sampling


def apply() -> None:
    from lmdeploy.pytorch.engine.logits_process import FusedLogitsProcessor

    wrap(FusedLogitsProcessor, "sampling", _patch_sampling)
