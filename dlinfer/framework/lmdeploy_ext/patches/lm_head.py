"""The quantised LM head (int8; int4 opt-in) on dlinfer's device types (written against LMDeploy 0.18.0).

Why: neither of LMDeploy's AWQ nor SmoothQuant formats quantises the LM head, so a quantised
small model still reads its whole float head every decode step (backend/lm_head.py).

How: `BaseModelAgent._build_model` (engine/model_agent/agent.py) builds the patched model
and loads its weights (`load_model_weights`, which ends with `process_weights_after_loading`:
a tied model's `update_weights` has tied the head to the embedding by then). For an agent of a
dlinfer device type, and no other, the wrapper reads DLINFER_LM_HEAD first (a bad value is a
ValueError before any weight is read), runs LMDeploy's `_build_model`, then hands the loaded
model to `backend.lm_head.apply_for_engine`, which replaces the `lm_head` module when the option
(or, for `auto`, a quantised checkpoint) asks for int8 or int4. Each tp rank runs its own `_build_model`
(the environment is inherited) and quantises its own copy of the unsplit head.
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend import lm_head
from dlinfer.framework.lmdeploy_ext.patching import wrap


def _patch_build_model(original):

    @functools.wraps(original)
    def _build_model(self):
        device_ctx = getattr(self, "device_ctx", None)
        if devices.spec_for(getattr(device_ctx, "device_type", None)) is None:
            return original(self)
        option = lm_head.read_option()
        original(self)
        lm_head.apply_for_engine(self.patched_model, self.model_config, option,
                                 weights_loaded=not self.misc_config.empty_init,
                                 model_path=getattr(self, "model_path", None))

    return _build_model


def apply() -> None:
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    wrap(BaseModelAgent, "_build_model", _patch_build_model)
