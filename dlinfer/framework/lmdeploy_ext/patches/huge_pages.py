"""The model's weights moved onto huge pages once built (written against LMDeploy 0.18.0).

Why: every decode step streams every weight; on 4 KB pages that pays a TLB miss per 4 KB (a
two-level page walk in a VM). On 2 MB pages the Intel Xeon VM's float32 few-row linear streamed
1.46x faster (dlinfer/utils/huge_pages.py; the end-to-end runs in docs/benchmarks.md, "Huge pages
for the weights").

How: `BaseModelAgent.build_model` (engine/model_agent/agent.py) builds the patched model and
loads its weights (the lm_head patch's int8 head and the vendor's load-time repack included). For
an agent of a dlinfer CPU device type, the wrapper then hands every parameter and buffer of the
model to `move_to_huge_pages` (copied into one 2 MB-page arena, each tensor re-pointed in place:
the same objects, the same values) and logs what it did. This runs before the warm-up, so the
graphs compiled then already see the moved weights. `DLINFER_HUGE_PAGES=0` leaves the memory as
allocated (for A/B measurements); any value but 0 or 1 is a ValueError. Other device types are
untouched: their weights are not in host memory.
"""

from __future__ import annotations

import functools
import logging
import os

from dlinfer import envs
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap
from dlinfer.utils.huge_pages import move_to_huge_pages

ENV = "DLINFER_HUGE_PAGES"
log = logging.getLogger("dlinfer.lmdeploy.huge_pages")


def enabled(environ=os.environ) -> bool:
    """DLINFER_HUGE_PAGES: unset or "1" -> True, "0" -> False; anything else is a ValueError."""
    value = envs.get(ENV, environ) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 1 (the default: weights on huge pages) or 0 (leave them)")
    return value == "1"


def _patch_build_model(original):

    @functools.wraps(original)
    def build_model(self, *args, **kwargs):
        spec = devices.spec_for(getattr(getattr(self, "device_ctx", None), "device_type", None))
        wanted = spec is not None and spec.torch_device == "cpu" and enabled()
        result = original(self, *args, **kwargs)
        model = getattr(self, "patched_model", None)
        if wanted and model is not None:
            report = move_to_huge_pages(list(model.parameters()) + list(model.buffers()))
            if report.problem is None:
                log.info("model weights on huge pages: %.0f MB", report.huge / 2**20)
            else:
                log.warning("model weights: %.0f of %.0f MB on huge pages: %s", report.huge / 2**20,
                            report.bytes / 2**20, report.problem)
        return result

    return build_model


def apply() -> None:
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    wrap(BaseModelAgent, "build_model", _patch_build_model)
