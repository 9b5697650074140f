"""Accept dlinfer's device types in `PytorchEngineConfig` (written against LMDeploy 0.18.0).

Why: `PytorchEngineConfig.__post_init__` (messages.py:604, :622) asserts `dtype` in
auto/float16/bfloat16 and `device_type` in cuda/ascend/maca/camb, so `device_type="cpu"` and
`dtype="float32"` fail before any engine code runs. Its KV-cache default
(`cache_max_entry_count=0.8` of free memory) suits a GPU, not the host RAM of a CPU machine.

How: for a dlinfer device type only (see `devices.py`), and only there,
- `__init__` fills the device's default `cache_max_entry_count` when the caller gave none;
- `__post_init__` first checks what the device can run (dtype, tp=dp=ep=1, no KV-cache
  quantization, in-process engine) and raises ValueError naming the allowed values, then runs
  LMDeploy's own checks with `device_type`/`dtype` shown as "cuda"/"auto" for the duration of
  the call, and restores them.
Other device types go straight to LMDeploy's code.
"""

from __future__ import annotations

import functools
import inspect

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap


def check_engine_config(config, spec: devices.DeviceSpec) -> None:
    """Raise ValueError for an engine setting `spec`'s device type cannot run."""
    name = spec.device_type
    if config.dtype != "auto" and config.dtype not in spec.dtypes:
        allowed = ", ".join(repr(d) for d in ("auto",) + spec.dtypes)
        raise ValueError(f"device_type={name!r} cannot run dtype={config.dtype!r}; choose one of {allowed}.")
    for field in ("tp", "dp", "ep"):
        if getattr(config, field) != 1:
            raise ValueError(f"device_type={name!r} runs one process on one device: {field} must be 1, "
                             f"got {getattr(config, field)}.")
    if int(config.quant_policy) != 0:
        raise ValueError(f"device_type={name!r} has no quantized KV cache: quant_policy must be 0, "
                         f"got {int(config.quant_policy)}.")
    if config.enable_mp_engine:
        raise ValueError(f"device_type={name!r} runs the engine in-process: enable_mp_engine must be False.")
    if config.distributed_executor_backend not in (None, "uni"):
        raise ValueError(f"device_type={name!r} runs LMDeploy's 'uni' executor only, "
                         f"got distributed_executor_backend={config.distributed_executor_backend!r}.")


def _patch_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        given = signature.bind_partial(self, *args, **kwargs).arguments
        spec = devices.spec_for(given.get("device_type"))
        if spec is not None and spec.cache_max_entry_count is not None and "cache_max_entry_count" not in given:
            kwargs["cache_max_entry_count"] = spec.cache_max_entry_count
        original(self, *args, **kwargs)

    return __init__


def _patch_post_init(original):

    @functools.wraps(original)
    def __post_init__(self):
        spec = devices.spec_for(self.device_type)
        if spec is None:
            return original(self)
        check_engine_config(self, spec)
        device_type, dtype = self.device_type, self.dtype
        self.device_type, self.dtype = "cuda", "auto"  # the only values LMDeploy's asserts know
        try:
            original(self)
        finally:
            self.device_type, self.dtype = device_type, dtype

    return __post_init__


def apply() -> None:
    from lmdeploy.messages import PytorchEngineConfig

    wrap(PytorchEngineConfig, "__init__", _patch_init)
    wrap(PytorchEngineConfig, "__post_init__", _patch_post_init)
