"""Route dlinfer's device types to dlinfer's ops backend (written against LMDeploy 0.18.0).

Why: `lmdeploy.pytorch.backends.selector._get_backend` (selector.py) knows cuda, ascend,
maca and camb and raises RuntimeError for any other device type.

How: `_get_backend` is wrapped; when the current LMDeploy device context names a dlinfer device
type it returns that device's backend class (`backend/op_backend.py`), otherwise LMDeploy's
answer. `get_backend(device_type)` calls `_get_backend` through the module global, so it is
covered too.
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap


def _patch_get_backend(original):

    @functools.wraps(original)
    def _get_backend():
        from lmdeploy.pytorch.devices import get_device_manager

        spec = devices.spec_for(get_device_manager().current_context().device_type)
        if spec is None:
            return original()
        from dlinfer.framework.lmdeploy_ext.backend.op_backend import backend_for

        return backend_for(spec)

    return _get_backend


def apply() -> None:
    import lmdeploy.pytorch.backends.selector as selector

    wrap(selector, "_get_backend", _patch_get_backend)
