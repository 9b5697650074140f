"""Free the warm-up thread's OpenMP pool after warm-up (written against LMDeploy 0.18.0).

Why: LMDeploy warms the engine up on the thread that builds it (`BaseModelAgent.warmup`,
engine/model_agent/agent.py, the caller's thread) and then serves every forward on the
pipeline's own event-loop thread. Both threads open OpenMP parallel regions, so libgomp keeps
two worker pools; with more pool threads than CPUs it stops spin-waiting and every parallel
region of a decode step (hundreds per step) pays a futex wake-up. Measured with SmolLM2-135M on
2 cores, eager, batch 1, three alternating pairs of fresh processes: 29-37 decode tokens/s with
the warm-up pool freed, 21-24 without.

How: `warmup` of an agent on a dlinfer CPU device type is followed by
`dlinfer.utils.openmp.release_thread_pool()` on the same thread (see that module). Nothing
changes for other device types, nor where the OpenMP runtime is not libgomp.
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap
from dlinfer.utils.openmp import release_thread_pool


def _patch_warmup(original):

    @functools.wraps(original)
    def warmup(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        spec = devices.spec_for(getattr(getattr(self, "device_ctx", None), "device_type", None))
        if spec is not None and spec.torch_device == "cpu":
            release_thread_pool()
        return result

    return warmup


def apply() -> None:
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    wrap(BaseModelAgent, "warmup", _patch_warmup)
