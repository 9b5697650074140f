"""Keep the whole KV history unless every layer reads only LMDeploy's cache window (LMDeploy 0.18.0).

Why: `ExecutorBase.__init__` (engine/executor/base.py) sets `cache_config.window_size` from
`model_config.sliding_window`, and with a window the scheduler's `WindowBlockManager` frees every
KV block older than the window (and the attention metadata then starts each sequence after them).
That is right when every layer is windowed by that amount (Mistral, Phi-3, Qwen2 with
use_sliding_window), but LMDeploy's config builders keep a config's `sliding_window` also where the
model's attention does not window every layer by it:
- Gemma 2 and Gemma 3's text model (configurations/gemma.py), whose global layers attend to the
  whole history (LMDeploy's own builder for the Gemma 3 VLM sets `sliding_window = -1` for that
  reason): a Gemma 3 prompt prefilled in chunks lost the history its global layer needed and
  answered otherwise than transformers (tests/lmdeploy/test_windowed_models.py found it);
- any model whose config carries a `sliding_window` its attention ignores (the default builder reads
  it when `use_sliding_window` is absent; a Llama config with one attends to everything in LMDeploy
  and in transformers), which would have attended to the last blocks only.

How: before LMDeploy's `ExecutorBase.__init__`, for a dlinfer device type, unless every layer
LMDeploy's model builds (`model_support.lmdeploy_layer_windows`) is windowed by exactly
`model_config.sliding_window`, that becomes -1, as LMDeploy's VLM builder does: the whole history is
kept, and each layer's attention still applies its own window (backend/scored_attention.py).
"""

from __future__ import annotations

import functools
import inspect

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend.model_support import architecture, lmdeploy_layer_windows
from dlinfer.framework.lmdeploy_ext.patching import wrap


def frees_needed_history(model_config) -> bool:
    """Whether LMDeploy's cache window (`model_config.sliding_window`) would free KV blocks that some
    layer of its model still reads: a window is set, and not every layer is windowed by it."""
    window = getattr(model_config, "sliding_window", -1)
    if not isinstance(window, int) or window <= 0:
        return False
    hf_config = model_config.hf_config
    language = getattr(hf_config, "text_config", None) or getattr(hf_config, "llm_config", None) or hf_config
    windows = lmdeploy_layer_windows(architecture(hf_config), language)
    return not windows or any(w != window for w in windows)


def _patch_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        model_config = given.get("model_config")
        if devices.spec_for(given.get("device_type")) is not None and model_config is not None \
                and frees_needed_history(model_config):
            model_config.sliding_window = -1
        return original(self, *args, **kwargs)

    return __init__


def apply() -> None:
    from lmdeploy.pytorch.engine.executor.base import ExecutorBase

    wrap(ExecutorBase, "__init__", _patch_init)
