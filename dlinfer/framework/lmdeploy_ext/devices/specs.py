"""The LMDeploy device types dlinfer adds, and what each of them means.

A device type here is a value of `PytorchEngineConfig.device_type` that LMDeploy 0.18 does not
know itself. Each one runs LMDeploy's own dlinfer layers (attention, norm, rotary, activation,
MoE) and its `kernels/dlinfer` wrappers on `dlinfer.ops`, with tensors on `torch_device`:

- "cpu": a plain CPU machine, ops from dlinfer's vendor for CPU tensors: the `cpu` vendor (C++
  kernels), or the `torch` vendor where those cannot be built (`python -m dlinfer env` says which).
- "dlinfer_cuda": a CUDA GPU through dlinfer's vendor for CUDA tensors (the `triton` vendor by
  default). Written for completeness of the design; not run on a GPU yet.

The patches under `patches/` consult `spec_for(device_type)`; a device type that is not listed
here (cuda, ascend, maca, camb, ...) is left entirely to LMDeploy.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    """What one dlinfer device type accepts and defaults to.

    device_type: the `PytorchEngineConfig.device_type` string.
    torch_device: the torch device type weights, KV cache and activations live on.
    dtypes: engine dtypes a user may ask for explicitly (besides "auto").
    auto_dtypes: checkpoint dtypes that dtype="auto" keeps as they are.
    auto_fallback: what dtype="auto" runs for any other checkpoint dtype.
    max_batch_size: default `max_batch_size` (LMDeploy asks the device when it is not given).
    cache_max_entry_count: default share of free memory for the KV cache, or None to keep
        LMDeploy's default (0.8).
    max_prefill_token_num: default token budget of one prefill step (longer prompts are prefilled
        in chunks of it, and a step admits waiting prompts up to it), or None to keep LMDeploy's
        default (8192).
    kv_cache_warn_share: a `cache_max_entry_count` at or above this share of free host RAM gets a
        `HostMemoryWarning` with the bytes it would commit (`patches/engine_config.py`), or None
        for no such warning (a device whose cache does not live in host RAM).
    ccl_backend: the torch.distributed backend of the ranks' collectives when tp > 1 (what
        LMDeploy's `init_process_group` and `DistContext.build` ask the ops backend for).
    shares_host_cores: whether the ranks of one machine share its CPU cores for their compute
        (so each rank gets a share of them: `patches/mp_executor.py`).
    ray_resource: the Ray resource one rank's placement bundle holds under LMDeploy's Ray executor
        (`patches/ray_executor.py`), or None where that executor is not run.
    """

    device_type: str
    torch_device: str
    dtypes: tuple[str, ...]
    auto_dtypes: tuple[str, ...]
    auto_fallback: str
    max_batch_size: int
    cache_max_entry_count: float | None
    max_prefill_token_num: int | None
    kv_cache_warn_share: float | None
    ccl_backend: str
    shares_host_cores: bool
    ray_resource: str | None = None


CPU = DeviceSpec(
    device_type="cpu",
    torch_device="cpu",
    dtypes=("float32", "bfloat16"),
    auto_dtypes=("float32", "bfloat16"),
    auto_fallback="float32",
    max_batch_size=64,
    # The KV cache is zero-filled, so every byte of it is committed RAM: LMDeploy's 0.8 of free
    # memory would leave the machine unusable. 0.1 of available RAM still holds tens of
    # thousands of tokens for small models; pass cache_max_entry_count or num_gpu_blocks for more.
    cache_max_entry_count=0.1,
    # A prefill step of LMDeploy's default 8192 tokens takes 8 s for SmolLM2-135M on 2 cores (more
    # for bigger models), and every prompt admitted to it waits for all of it: a burst of long
    # prompts gets no first token until the whole burst is prefilled. 512-token steps halved the
    # median time to first token of 32 x 256-token prompts, with the burst done no later
    # (docs/benchmarks.md, "Time to first token under a burst").
    max_prefill_token_num=512,
    # Half or more of the free RAM in zero-filled KV pages is "most of the machine": warn.
    kv_cache_warn_share=0.5,
    ccl_backend="gloo",
    shares_host_cores=True,
    ray_resource="CPU",
)

DLINFER_CUDA = DeviceSpec(
    device_type="dlinfer_cuda",
    torch_device="cuda",
    dtypes=("float16", "bfloat16", "float32"),
    auto_dtypes=("float16", "bfloat16"),
    auto_fallback="float16",
    max_batch_size=128,
    cache_max_entry_count=None,
    max_prefill_token_num=None,
    kv_cache_warn_share=None,
    ccl_backend="nccl",
    shares_host_cores=False,
)

DEVICES: dict[str, DeviceSpec] = {spec.device_type: spec for spec in (CPU, DLINFER_CUDA)}


def spec_for(device_type: str | None) -> DeviceSpec | None:
    """The DeviceSpec of a dlinfer device type, None for any other device type."""
    return DEVICES.get(device_type)  # type: ignore[arg-type]


# The torch device of the engine whose asyncio tasks are running, set by the model-agent patch
# around `BaseModelAgent.start` so the tasks it creates inherit it. Lets module-level LMDeploy
# helpers that hard-code "cuda" (agent.py `_try_to_cuda`) move tensors to the right device
# without reading the process-global LMDeploy device context.
_ENGINE_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dlinfer_lmdeploy_engine_device", default=None
)


def engine_device() -> str | None:
    """The torch device type of the dlinfer engine running in this context, if any."""
    return _ENGINE_DEVICE.get()


@contextlib.contextmanager
def engine_device_scope(torch_device: str) -> Iterator[None]:
    """Make `engine_device()` return `torch_device` inside the block (and in tasks it creates)."""
    token = _ENGINE_DEVICE.set(torch_device)
    try:
        yield
    finally:
        _ENGINE_DEVICE.reset(token)
