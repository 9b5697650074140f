"""Answer LMDeploy's per-device queries for dlinfer's device types (LMDeploy 0.18.0).

Why: `lmdeploy.utils.get_max_batch_size` (utils.py) asserts the device type is one of
LMDeploy's own and asks CUDA for the GPU name; `is_bf16_supported` (utils.py) returns False
for unknown device types, which makes LMDeploy turn bfloat16 checkpoints into float16.

How: both functions are wrapped; a dlinfer device type gets its answer from `devices/specs.py`
(bf16: always on CPU, LMDeploy's CUDA answer for dlinfer_cuda), every other device type gets
LMDeploy's. They are replaced in `lmdeploy.utils` and in the two modules that imported them by
name before we could patch (`pytorch.engine.config_builder`, `pytorch.config`).

Also `flash_mla_available` (pytorch/configurations/utils.py), which DeepSeek-V2/V3's config
builder calls whatever the device type: it asks CUDA for device 0's properties and catches only
an ImportError, so on a torch without CUDA (this CPU build) its AssertionError ended LMDeploy's
model check ("Torch not compiled with CUDA enabled"). Without CUDA there is no FlashMLA: the
wrapper answers False then, LMDeploy's function otherwise.
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import original_of, wrap


def _patch_get_max_batch_size(original):

    @functools.wraps(original)
    def get_max_batch_size(device_type: str):
        spec = devices.spec_for(device_type)
        return original(device_type) if spec is None else spec.max_batch_size

    return get_max_batch_size


def _patch_is_bf16_supported(original):

    @functools.wraps(original)
    def is_bf16_supported(device_type: str = "cuda"):
        spec = devices.spec_for(device_type)
        if spec is None:
            return original(device_type)
        if spec.torch_device == "cpu":
            return True
        return original(spec.torch_device)

    return is_bf16_supported


def _patch_flash_mla_available(original):

    @functools.wraps(original)
    def flash_mla_available():
        import torch

        return original() if torch.cuda.is_available() else False

    return flash_mla_available


def apply() -> None:
    import lmdeploy.pytorch.config as pytorch_config
    import lmdeploy.pytorch.configurations.deepseek_v2 as deepseek_v2_config
    import lmdeploy.pytorch.configurations.utils as configuration_utils
    import lmdeploy.pytorch.engine.config_builder as config_builder
    import lmdeploy.utils as utils

    wrap(utils, "get_max_batch_size", _patch_get_max_batch_size)
    wrap(utils, "is_bf16_supported", _patch_is_bf16_supported)
    wrap(configuration_utils, "flash_mla_available", _patch_flash_mla_available)
    wrap(deepseek_v2_config, "flash_mla_available", _patch_flash_mla_available)  # imported by name
    # Modules that did `from lmdeploy.utils import ...` hold the unpatched function: point them at
    # the patched one (only if they still hold LMDeploy's original).
    for module, name in ((config_builder, "get_max_batch_size"), (pytorch_config, "is_bf16_supported")):
        if original_of(getattr(module, name)) is original_of(getattr(utils, name)):
            setattr(module, name, getattr(utils, name))
