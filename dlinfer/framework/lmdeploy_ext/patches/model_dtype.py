"""Pick the model dtype for dlinfer's device types (written against LMDeploy 0.18.0).

Why: `lmdeploy.pytorch.config._update_torch_dtype` (config.py) turns dtype="auto" into
float16 for any checkpoint that is not float16/bfloat16, so a float32 checkpoint
would run in float16 on a CPU, which the CPU device does not run.

How: for a dlinfer device type the dtype is chosen here and handed to LMDeploy's function as an
explicit dtype (which it then applies as it applies a user's choice):
- dtype="auto" keeps the checkpoint's dtype when the device runs it (`DeviceSpec.auto_dtypes`),
  otherwise runs `DeviceSpec.auto_fallback` (float32 on CPU: exact for float16 checkpoints);
- an explicit dtype must be one the device runs (`DeviceSpec.dtypes`), else ValueError;
- AWQ checkpoints, which LMDeploy always runs in float16, run in that chosen dtype too
  (patches/awq_linear.py gives AwqLinear's scales the same dtype).
Other device types go straight to LMDeploy's function.
"""

from __future__ import annotations

import functools

import torch
from lmdeploy.utils import get_logger

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap

logger = get_logger("lmdeploy")


def checkpoint_dtype(hf_config) -> str | None:
    """The dtype name a HF config declares ('float32', 'bfloat16', ...), None if it declares none."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is None:
            continue
        for key in ("dtype", "torch_dtype"):
            value = getattr(cfg, key, None)
            if isinstance(value, torch.dtype):
                return str(value).removeprefix("torch.")
            if isinstance(value, str):
                return value
    return None


def choose_dtype(spec: devices.DeviceSpec, requested: str, checkpoint: str | None) -> str:
    """The dtype name a model runs in on `spec`'s device."""
    if requested != "auto":
        if requested not in spec.dtypes:
            allowed = ", ".join(repr(d) for d in ("auto",) + spec.dtypes)
            raise ValueError(f"device_type={spec.device_type!r} cannot run dtype={requested!r}; "
                             f"choose one of {allowed}.")
        return requested
    if checkpoint in spec.auto_dtypes and (checkpoint != "bfloat16" or _bf16_supported(spec)):
        return checkpoint
    logger.info(f"device_type={spec.device_type!r}: checkpoint dtype {checkpoint} runs as {spec.auto_fallback}.")
    return spec.auto_fallback


def _bf16_supported(spec: devices.DeviceSpec) -> bool:
    import lmdeploy.utils

    return lmdeploy.utils.is_bf16_supported(spec.device_type)


def _patch_update_torch_dtype(original):

    @functools.wraps(original)
    def _update_torch_dtype(config, dtype: str, device_type: str = "auto"):
        spec = devices.spec_for(device_type)
        if spec is None:
            return original(config, dtype, device_type=device_type)
        chosen = choose_dtype(spec, dtype, checkpoint_dtype(config.hf_config))
        result = original(config, chosen, device_type=device_type)
        quant = getattr(config.hf_config, "quantization_config", None)
        if isinstance(quant, dict) and quant.get("quant_method") == "awq":
            # LMDeploy forced float16 for AWQ (in `_update_torch_dtype`): run `chosen` and tell AwqLinear
            # (patches/awq_linear.py) through the quantization config every module is built with.
            from dlinfer.framework.lmdeploy_ext.patches.awq_linear import DTYPE_KEY

            config.hf_config.torch_dtype = chosen
            config.dtype = getattr(torch, chosen)
            quant[DTYPE_KEY] = chosen
        return result

    return _update_torch_dtype


def apply() -> None:
    import lmdeploy.pytorch.config as pytorch_config

    wrap(pytorch_config, "_update_torch_dtype", _patch_update_torch_dtype)
