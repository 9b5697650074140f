"""Per-step memo for metadata derived from the same tensors in every layer.

Within one forward step an engine passes the same length / block-table tensors to the attention
ops of every layer (LMDeploy even passes fresh views of them, `cu_seqlens_q_cpu[1:]`, per call).
Deriving canonical metadata from them (cumulative offsets, int32 casts, a decode gather plan) once
per step instead of once per layer removes most host overhead of small decode steps.

A tensor argument matches when it views the same memory the same way (data pointer, shape,
strides, dtype, device) with an unchanged version counter (shared by all views of a tensor and
bumped by any in-place write). The memo keeps the previous arguments alive, so their memory
cannot be reused by a new tensor while remembered: a match means the same data. It is bypassed
while torch.compile traces.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch


class LastCallMemo:
    """Remembers f(*args) for the last args seen (tensors compared by identity and version)."""

    __slots__ = ("_fn", "_key", "_args", "_value")

    def __init__(self, fn: Callable):
        self._fn = fn
        self._key = None
        self._args: Tuple = ()  # kept alive on purpose (see the module docstring)
        self._value: Any = None

    @staticmethod
    def _key_of(args) -> tuple:
        return tuple(
            (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device, a._version) if isinstance(a, torch.Tensor) else a
            for a in args
        )

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self._fn(*args)
        key = self._key_of(args)
        if key == self._key:
            return self._value
        value = self._fn(*args)
        self._args, self._key, self._value = args, key, value
        return value

    def clear(self) -> None:
        self._key, self._args, self._value = None, (), None
