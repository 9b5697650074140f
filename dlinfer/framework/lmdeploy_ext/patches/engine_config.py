"""Accept dlinfer's device types in `PytorchEngineConfig` (written against LMDeploy 0.18.0).

Why: `PytorchEngineConfig.__post_init__` (messages.py) asserts `dtype` in
auto/float16/bfloat16 and `device_type` in cuda/ascend/maca/camb, so `device_type="cpu"` and
`dtype="float32"` fail before any engine code runs. Its defaults suit a GPU, not the host RAM and
few cores of a CPU machine: `cache_max_entry_count=0.8` of free memory (zero-filled, so
committed RAM) and `max_prefill_token_num=8192` tokens per prefill step (8 s of a 2-core CPU for
a 135M model, more for bigger ones, during which no admitted prompt gets its first token). And
settings LMDeploy's `EngineChecker.check` (engine/engine_checker.py) refuses end in
`exit(1)`, a `SystemExit` from deep inside `pipeline()` (or the death of the serving engine's
process), not in an error naming the setting.

How: for a dlinfer device type only (see `devices/specs.py`), and only there,
- `__init__` fills the device's defaults (`cache_max_entry_count`, `max_prefill_token_num`) when
  the caller gave none or passed None (LMDeploy's CLI always passes both: `serve.py` passes None
  to mean "the device's default");
- `__post_init__` first checks what the device can run (dtype; tp >= 1 with dp = ep = 1 and
  the 'uni' (tp = 1), 'mp' or, where the device type has a Ray resource, 'ray' executor, 'mp'
  chosen when tp > 1 asks for none (LMDeploy would take Ray); quant_policy 0 or 8 (8: the int8 KV cache,
  tp = 1 only; its scales file is checked when the engine is built,
  `backend/kv_int8.py`); the 'mp' multi-process engine) and what LMDeploy's engine
  checker would exit on (`max_batch_size` >= 1, `num_gpu_blocks` 0 or >= 16, no `thread_safe`,
  `block_size == kernel_block_size` outside the hybrid role) plus `max_prefill_token_num` >= 1,
  raising ValueError naming the setting; then runs LMDeploy's own checks with
  `device_type`/`dtype` shown as "cuda"/"auto" for the duration of the call, and restores them;
  last, warns (`HostMemoryWarning`, with the bytes) when the KV-cache share would commit
  `DeviceSpec.kv_cache_warn_share` or more of the free host RAM.
Other device types go straight to LMDeploy's code.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import psutil

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap

# LMDeploy's EngineChecker.check: `0 < num_gpu_blocks < 16` exits ("should be greater than 16",
# but 16 itself passes).
MIN_NUM_GPU_BLOCKS = 16

# The `DeviceSpec` fields that are also `PytorchEngineConfig` fields with a per-device default.
_DEVICE_DEFAULTS = ("cache_max_entry_count", "max_prefill_token_num")


class HostMemoryWarning(UserWarning):
    """A dlinfer engine setting would commit most of the machine's free RAM."""


def check_engine_config(config, spec: devices.DeviceSpec) -> None:
    """Raise ValueError for an engine setting `spec`'s device type cannot run."""
    name = spec.device_type
    if config.dtype != "auto" and config.dtype not in spec.dtypes:
        allowed = ", ".join(repr(d) for d in ("auto",) + spec.dtypes)
        raise ValueError(f"device_type={name!r} cannot run dtype={config.dtype!r}; choose one of {allowed}.")
    check_parallel(config, spec)
    if int(config.quant_policy) not in (0, 8):
        raise ValueError(f"device_type={name!r} runs quant_policy=0 (KV cache in the model dtype) or 8 (the int8 "
                         f"KV cache, with the model folder's kv_int8_scales.safetensors); got quant_policy="
                         f"{int(config.quant_policy)} (4: the int4 KV cache is not implemented).")
    if int(config.quant_policy) == 8 and config.tp != 1:
        raise ValueError(f"device_type={name!r}: quant_policy=8 runs with tp=1 only (the per-head KV scales are "
                         f"not split across ranks yet); got tp={config.tp}.")
    if config.enable_mp_engine and config.mp_engine_backend != "mp":
        raise ValueError(f"device_type={name!r} runs the multi-process engine with mp_engine_backend='mp' only, "
                         f"got mp_engine_backend={config.mp_engine_backend!r}.")
    check_engine_limits(config, spec)


def check_parallel(config, spec: devices.DeviceSpec) -> None:
    """Raise ValueError for a parallel layout `spec`'s device type cannot run: tensor parallel
    (tp >= 1) runs through LMDeploy's 'mp' executor (tp == 1 also through 'uni'), or its 'ray'
    executor where the device type has a Ray resource; data and expert parallel are refused by
    name (docs/lmdeploy.md, "Tensor parallel")."""
    name = spec.device_type
    if config.tp < 1:
        raise ValueError(f"device_type={name!r}: tp must be at least 1, got {config.tp}.")
    if config.dp != 1:
        raise ValueError(f"device_type={name!r} has no data parallel: dp must be 1, got {config.dp} (LMDeploy's "
                         "dp > 1 runs MoE models' attention data-parallel with expert parallel, which dlinfer's "
                         "fused_moe does not do; for more throughput run one server per replica).")
    if config.ep != 1:
        raise ValueError(f"device_type={name!r} has no expert parallel: ep must be 1, got {config.ep} (dlinfer's "
                         "fused_moe has no all-to-all dispatch over moe_metadata; use tp, which splits every "
                         "expert's MLP over the ranks).")
    backend = config.distributed_executor_backend
    allowed = ("uni", "mp", "ray") if config.tp == 1 else ("mp", "ray")
    if backend == "ray" and spec.ray_resource is None:
        raise ValueError(f"device_type={name!r} does not run LMDeploy's Ray executor (not checked on its devices "
                         f"yet); use distributed_executor_backend='mp' or None.")
    if backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError(f"distributed_executor_backend='ray' needs Ray: pip install 'dlinfer[ray]' "
                             f"(device_type={name!r})") from None
    if backend is not None and backend not in allowed:
        raise ValueError(f"device_type={name!r} with tp={config.tp} runs LMDeploy's "
                         f"{' or '.join(repr(a) for a in allowed)} executor, "
                         f"got distributed_executor_backend={backend!r}.")


def check_engine_limits(config, spec: devices.DeviceSpec) -> None:
    """Raise ValueError for what LMDeploy's `EngineChecker.check` would `exit(1)` on once the engine
    is being built (and for a prefill budget no step could run)."""
    name = spec.device_type
    if config.max_batch_size is not None and config.max_batch_size < 1:
        raise ValueError(f"device_type={name!r}: max_batch_size must be at least 1 (or None for the device's "
                         f"default, {spec.max_batch_size}), got {config.max_batch_size}.")
    if 0 < config.num_gpu_blocks < MIN_NUM_GPU_BLOCKS:
        raise ValueError(f"device_type={name!r}: num_gpu_blocks must be 0 (size the KV cache from "
                         f"cache_max_entry_count) or at least {MIN_NUM_GPU_BLOCKS}, got {config.num_gpu_blocks}.")
    if config.max_prefill_token_num < 1:
        raise ValueError(f"device_type={name!r}: max_prefill_token_num (tokens per prefill step) must be at "
                         f"least 1, got {config.max_prefill_token_num}.")
    if config.thread_safe:
        raise ValueError(f"device_type={name!r}: thread_safe=True is no longer supported by LMDeploy; "
                         "leave it False.")
    kernel_block_size = config.block_size if config.kernel_block_size == -1 else config.kernel_block_size
    if getattr(config.role, "name", config.role) != "Hybrid" and config.block_size != kernel_block_size:
        role = getattr(config.role, 'name', config.role)
        raise ValueError(f"device_type={name!r}: role={role} (PD migration) needs block_size == "
                         f"kernel_block_size, got {config.block_size} and {kernel_block_size}.")


def warn_host_memory(config, spec: devices.DeviceSpec) -> None:
    """Warn when the KV cache would take `spec.kv_cache_warn_share` or more of the free host RAM.

    The estimate, `cache_max_entry_count` x RAM available now, is what LMDeploy commits at most:
    it applies the share to what is free after the weights and a logits reserve
    (`ExecutorBase._get_runtime_size` and `ExecutorBase._update_num_gpu_blocks` in executor/base.py).
    With `num_gpu_blocks` given, the share is not used."""
    share = spec.kv_cache_warn_share
    if share is None or config.num_gpu_blocks > 0 or config.cache_max_entry_count < share:
        return
    memory = psutil.virtual_memory()
    nbytes = int(config.cache_max_entry_count * memory.available)
    warnings.warn(
        f"device_type={spec.device_type!r}: cache_max_entry_count={config.cache_max_entry_count} would commit up to "
        f"{nbytes} bytes ({nbytes / 2**30:.1f} GiB) of zero-filled host RAM for the KV cache: "
        f"{config.cache_max_entry_count:.0%} of the {memory.available / 2**30:.1f} GiB available now "
        f"({memory.total / 2**30:.1f} GiB total). Shares of {share} or more leave the machine little; "
        f"the device's default is {spec.cache_max_entry_count}, or set num_gpu_blocks.",
        HostMemoryWarning, stacklevel=5)  # the caller of PytorchEngineConfig(...)


def _patch_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        given = signature.bind_partial(self, *args, **kwargs).arguments
        spec = devices.spec_for(given.get("device_type"))
        if spec is not None:
            for field in _DEVICE_DEFAULTS:
                if field in given and (given[field] is not None or field not in kwargs):
                    continue  # a value, or None given positionally (left to LMDeploy's asserts)
                default = getattr(spec, field)
                if default is not None:
                    kwargs[field] = default
                elif field in kwargs:  # None given: LMDeploy's own default
                    del kwargs[field]
        original(self, *args, **kwargs)

    return __init__


def _patch_post_init(original):

    @functools.wraps(original)
    def __post_init__(self):
        spec = devices.spec_for(self.device_type)
        if spec is None:
            return original(self)
        check_engine_config(self, spec)
        if self.tp > 1 and self.distributed_executor_backend is None:
            self.distributed_executor_backend = "mp"  # not Ray, which LMDeploy picks where the backend supports it
        device_type, dtype = self.device_type, self.dtype
        self.device_type, self.dtype = "cuda", "auto"  # the only values LMDeploy's asserts know
        try:
            original(self)
        finally:
            self.device_type, self.dtype = device_type, dtype
        warn_host_memory(self, spec)  # after LMDeploy's asserts: the share is in (0, 1)

    return __post_init__


def apply() -> None:
    from lmdeploy.messages import PytorchEngineConfig

    wrap(PytorchEngineConfig, "__init__", _patch_init)
    wrap(PytorchEngineConfig, "__post_init__", _patch_post_init)
