"""Checkpoint tensors read into fresh tensors, not views of a mapped file, for CPU device types
(written against LMDeploy 0.18.0).

Why: LMDeploy reads safetensors through `safe_open` (weight_loader/model_weight_loader.py,
`_get_safetensors_weights_iterator`), which maps the whole shard; the mapped pages a load touches
count in the process's resident memory until the shard is closed. On the GPU that mapping is
transient host memory beside device memory; on the CPU it sits on top of the model's own copy:
loading a Llama-3.2-1B-shaped checkpoint in bf16 peaked at the weights twice (2.30 GiB of
weights, 2.47 GiB of the file mapped), a 5 GB shard of an 8B model adds 5 GB to its peak
(docs/lmdeploy.md, "Memory while loading").

How: `BaseModelAgent._build_model` loads a built model with the agent module's
`load_model_weights(model, path, device=self.device)` (engine/model_agent/agent.py). When that
device is the CPU, which only a dlinfer CPU device type gives an agent (`patches/model_agent.py`
sets it from the device's spec), the wrapper sets a context variable for the duration of the call,
and `ModelWeightLoader._get_weights_iterator` then yields the tensors of a safetensors shard from
`dlinfer.utils.safetensors_reader.read_tensors` (each read with `readinto` into its own tensor,
which LMDeploy's weight loaders copy into the model and drop): the same names, dtypes, shapes and
values, in file order. Other devices, other checkpoint formats (.bin) and every other caller keep
LMDeploy's reader. (`_build_model` itself is the lm_head patch's: one attribute, one patch.)
"""

from __future__ import annotations

import contextvars
import functools

import torch

from dlinfer.framework.lmdeploy_ext.patching import wrap
from dlinfer.utils.safetensors_reader import read_tensors

_plain_reads = contextvars.ContextVar("dlinfer_plain_weight_reads", default=False)


def _patch_load_model_weights(original):

    @functools.wraps(original)
    def load_model_weights(*args, **kwargs):
        device = kwargs.get("device", args[3] if len(args) > 3 else None)
        token = _plain_reads.set(device is not None and torch.device(device).type == "cpu")
        try:
            return original(*args, **kwargs)
        finally:
            _plain_reads.reset(token)

    return load_model_weights


def _patch_weights_iterator(original):

    @functools.wraps(original)
    def _get_weights_iterator(self, path):
        if _plain_reads.get() and getattr(self, "_weight_type", None) == "safetensors":
            return read_tensors(path, getattr(self, "_prefix", None))
        return original(self, path)

    return _get_weights_iterator


def apply() -> None:
    from lmdeploy.pytorch.engine.model_agent import agent
    from lmdeploy.pytorch.weight_loader.model_weight_loader import ModelWeightLoader

    wrap(agent, "load_model_weights", _patch_load_model_weights)
    wrap(ModelWeightLoader, "_get_weights_iterator", _patch_weights_iterator)
