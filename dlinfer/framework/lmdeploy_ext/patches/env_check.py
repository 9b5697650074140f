"""Check torch on the device a dlinfer engine runs on (written against LMDeploy 0.18.0).

Why: `EngineChecker.__init__` (engine/engine_checker.py) always builds a `TorchChecker()` whose
check adds two tensors on "cuda" (`TorchChecker.check` in check_env/torch.py); on a machine
without CUDA that check fails and LMDeploy exits the process (`exit(1)`), whatever the device type.

How: after LMDeploy's `EngineChecker.__init__`, for a dlinfer device type only, every
TorchChecker in its tree of required checkers checks the device type's torch device instead.
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap


def _checkers(root):
    """`root` and every checker it requires, depth first, each once."""
    seen, stack = set(), [root]
    while stack:
        checker = stack.pop()
        if id(checker) in seen:
            continue
        seen.add(id(checker))
        yield checker
        stack.extend(getattr(checker, "_required_checker", ()))


def _patch_init(original):

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        spec = devices.spec_for(self.engine_config.device_type)
        if spec is None:
            return
        from lmdeploy.pytorch.check_env.torch import TorchChecker

        for checker in _checkers(self):
            if isinstance(checker, TorchChecker):
                checker.device = spec.torch_device

    return __init__


def apply() -> None:
    from lmdeploy.pytorch.engine.engine_checker import EngineChecker

    wrap(EngineChecker, "__init__", _patch_init)
