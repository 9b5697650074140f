"""Place a dlinfer engine's model agent on its device (written against LMDeploy 0.18.0).

Why: `BaseModelAgent` (engine/model_agent/agent.py) is CUDA-only in three per-engine ways:
`self.device = 'cuda'` (:363) decides where weights load and where `build_graph_runner` runs;
warm-up builds its dummy inputs with `device='cuda'` (:492, :506, :550); `get_free_mem` (:476)
asks CUDA for free memory, which sizes the KV cache. And the per-step input upload
(`_try_to_cuda`, see `cuda_calls.py`) needs to know which engine is running.

How: for an agent whose device context names a dlinfer device type, and for no other:
- `__init__` first refuses models and engine features the device cannot run
  (`backend/model_support.py`: before any weight is loaded, so a bad model is one clear error)
  and, for quant_policy=8, reads the int8 KV cache's scales file (`backend/kv_int8.py`: a
  missing one is refused there, naming the file and the command that writes it),
  then runs LMDeploy's `__init__` and sets `self.device` to the device's torch device, and gives
  this agent's inputs strategy a `make_dummy` that builds dummies there;
- `get_free_mem` returns available host RAM when the device is the CPU;
- `start` runs inside `devices.engine_device_scope`, so the asyncio tasks it creates (input
  upload, forward loop) carry the engine's torch device for `_try_to_cuda`;
- `wakeup` on the CPU: a level-1 `sleep` "offloads" the weights to the CPU, where they already
  are, and drops the KV cache and the graphs. LMDeploy's `wakeup` would move them back with
  `.to(torch.cuda.current_device())`, which raises on a CPU engine (the /wakeup endpoint
  answered 500 and the server stayed asleep); with the weights on the CPU the wrapper leaves
  them and lets LMDeploy rebuild the KV cache and warm up.
"""

from __future__ import annotations

import functools
import inspect

import psutil

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend import kv_int8
from dlinfer.framework.lmdeploy_ext.backend.model_support import check_engine_features, check_model
from dlinfer.framework.lmdeploy_ext.patching import wrap


def _agent_spec(agent) -> devices.DeviceSpec | None:
    device_ctx = getattr(agent, "device_ctx", None)
    return devices.spec_for(getattr(device_ctx, "device_type", None))


def _make_dummy_on(make_dummy, device: str):
    """`make_dummy` with its `device` argument (3rd, or keyword) forced to `device`."""

    @functools.wraps(make_dummy)
    def make_dummy_on_device(batch_size, is_decoding, *args, **kwargs):
        if args:
            args = (device,) + args[1:]
        else:
            kwargs["device"] = device
        return make_dummy(batch_size, is_decoding, *args, **kwargs)

    return make_dummy_on_device


def _patch_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        spec = devices.spec_for(getattr(given.get("device_ctx"), "device_type", None))
        if spec is None:
            return original(self, *args, **kwargs)
        check_model(given["model_config"], spec)
        check_engine_features(spec,
                              specdecode_config=given.get("specdecode_config"),
                              memdecode_config=getattr(given["misc_config"], "memdecode_config", None))
        kv_int8.load_for_engine(given["model_path"], given["model_config"], given["cache_config"], spec.torch_device)
        original(self, *args, **kwargs)
        self.device = spec.torch_device
        strategy = self.inputs_strategy
        strategy.make_dummy = _make_dummy_on(strategy.make_dummy, spec.torch_device)

    return __init__


def _patch_get_free_mem(original):

    @functools.wraps(original)
    def get_free_mem(self):
        spec = _agent_spec(self)
        if spec is None or spec.torch_device != "cpu":
            return original(self)
        return psutil.virtual_memory().available

    return get_free_mem


def _patch_start(original):

    @functools.wraps(original)
    def start(self, *args, **kwargs):
        spec = _agent_spec(self)
        if spec is None:
            return original(self, *args, **kwargs)
        with devices.engine_device_scope(spec.torch_device):
            return original(self, *args, **kwargs)

    return start


def _patch_wakeup(original):

    @functools.wraps(original)
    def wakeup(self, tags=None):
        spec = _agent_spec(self)
        if spec is None or spec.torch_device != "cpu":
            return original(self, tags)
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        weights = next(self.patched_model.get_model().parameters(), None)
        if "weights" in tags and weights is not None and weights.device.type == "cpu":
            tags.remove("weights")  # already in place: level 1 on the CPU moved nothing
        return original(self, tags)

    return wakeup


def apply() -> None:
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    wrap(BaseModelAgent, "__init__", _patch_init)
    wrap(BaseModelAgent, "get_free_mem", _patch_get_free_mem)
    wrap(BaseModelAgent, "start", _patch_start)
    wrap(BaseModelAgent, "wakeup", _patch_wakeup)
