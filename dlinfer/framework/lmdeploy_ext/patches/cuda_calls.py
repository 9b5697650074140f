"""Where LMDeploy's CUDA-only calls are redirected: the one place (written against LMDeploy 0.18.0).

Why: on the path a tp=1 engine takes, LMDeploy 0.18 calls CUDA directly:
- streams and events: `engine/model_agent/agent.py` (:235 `model_forward`, :356-358 three
  `torch.cuda.Stream()`, :479 `empty_cache`, :500/:515/:529/:559 warm-up `synchronize`/`stream`,
  :717 `Event()` per step, :1197 background loop, :1250-1256 input upload, :1368-1371 output
  download, :1997 close), `engine/cache_engine/engine.py` (:94 `current_stream`, :96 `Event()`),
  `engine/logits_process.py` (:388, :414, guided decoding only); a tensor-parallel rank's
  `torch.cuda.set_device(rank)` (`ExecutorProc._main_loop` in engine/executor/mp_executor.py);
- "cuda" as a device string: agent.py `_try_to_cuda` (:279-287, the per-step upload of inputs),
  `self.device = 'cuda'` (:363, weights and warm-up inputs) and the warm-up dummies (:492, :506,
  :550). The last two are per-engine and handled in `model_agent.py`.

How, narrowest scope first:
1. Only if this process has no usable CUDA device, the four modules above get a module-global
   `torch` whose `.cuda` is `host_cuda.HOST_CUDA` (streams/events with host semantics); every
   other attribute is the real torch. The global `torch.cuda` is untouched, so transformers,
   xgrammar and Inductor still see the truth. With a usable CUDA device nothing is replaced:
   LMDeploy's stream calls are then real and harmless for a CPU engine, and a CUDA engine in the
   same process keeps real CUDA.
2. `_try_to_cuda` moves a value to the torch device of the dlinfer engine whose tasks are
   running (`devices.engine_device()`, set by `model_agent.py`), and keeps LMDeploy's behaviour
   ("cuda") for every other engine.
"""

from __future__ import annotations

import functools
import importlib

import torch

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.host_cuda import TorchWithHostCuda
from dlinfer.framework.lmdeploy_ext.patching import wrap

MODULES_WITH_CUDA_CALLS: tuple[str, ...] = (
    "lmdeploy.pytorch.engine.model_agent.agent",
    "lmdeploy.pytorch.engine.cache_engine.engine",
    "lmdeploy.pytorch.engine.logits_process",
    "lmdeploy.pytorch.engine.executor.mp_executor",
)


def _patch_try_to_cuda(original):

    @functools.wraps(original)
    def _try_to_cuda(val, non_blocking: bool = False):
        device = devices.engine_device()
        if device is None or val is None:
            return original(val, non_blocking=non_blocking)
        if isinstance(val, torch.Tensor):
            return val.to(device, non_blocking=non_blocking)
        if hasattr(val, "to_device"):
            return val.to_device(device, non_blocking=non_blocking)
        raise RuntimeError(f"Can not move {type(val)} to {device}.")

    return _try_to_cuda


def apply() -> None:
    if not torch.cuda.is_available():
        for name in MODULES_WITH_CUDA_CALLS:
            wrap(importlib.import_module(name), "torch", lambda real_torch: TorchWithHostCuda())
    agent = importlib.import_module("lmdeploy.pytorch.engine.model_agent.agent")
    wrap(agent, "_try_to_cuda", _patch_try_to_cuda)
