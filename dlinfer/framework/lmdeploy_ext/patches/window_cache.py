"""Keep the whole KV history of models that window only some layers (written against LMDeploy 0.18.0).

Why: `ExecutorBase.__init__` (engine/executor/base.py) sets `cache_config.window_size` from
`model_config.sliding_window`, and with a window the scheduler's `WindowBlockManager` frees every
KV block older than the window (and the attention metadata then starts each sequence after them).
That is right when every layer is windowed (Mistral, Phi-3, Qwen2 with use_sliding_window), but
LMDeploy's config builder for Gemma 2 and Gemma 3's text model (configurations/gemma.py) keeps
the config's window although their global layers attend to the whole history: LMDeploy's own
builder for the Gemma 3 VLM sets `sliding_window = -1` for that reason. A Gemma 3 prompt prefilled
in chunks lost the history its global layer needed and answered otherwise than transformers
(tests/lmdeploy/test_windowed_models.py found it).

How: before LMDeploy's `ExecutorBase.__init__`, for a dlinfer device type, when the layers LMDeploy's
model windows (`model_support.lmdeploy_layer_windows`) are some but not all of them,
`model_config.sliding_window` becomes -1, as LMDeploy's VLM builder does: the whole history is
kept, and each layer's attention still applies its own window (backend/scored_attention.py).
"""

from __future__ import annotations

import functools
import inspect

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend.model_support import architecture, lmdeploy_layer_windows
from dlinfer.framework.lmdeploy_ext.patching import wrap


def windows_some_layers(model_config) -> bool:
    """Whether LMDeploy's model for `model_config` windows some of its layers but not all."""
    hf_config = model_config.hf_config
    windows = lmdeploy_layer_windows(architecture(hf_config), getattr(hf_config, "text_config", None) or hf_config)
    return any(w is not None for w in windows) and any(w is None for w in windows)


def _patch_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        model_config = given.get("model_config")
        if devices.spec_for(given.get("device_type")) is not None and model_config is not None \
                and windows_some_layers(model_config):
            model_config.sliding_window = -1
        return original(self, *args, **kwargs)

    return __init__


def apply() -> None:
    from lmdeploy.pytorch.engine.executor.base import ExecutorBase

    wrap(ExecutorBase, "__init__", _patch_init)
