"""Per-step memo for metadata derived from the same small tensors in every layer.

Within one forward step an engine passes the same length / block-table tensors to the attention
ops of every layer (LMDeploy passes fresh views of them, `cu_seqlens_q_cpu[1:]`, per call).
Deriving canonical metadata from them (cumulative offsets, int32 casts, a decode gather plan)
once per step instead of once per layer removes most host overhead of small decode steps.

Only for SMALL metadata tensors. A tensor argument matches the remembered one when:
- on the CPU: same dtype, shape and strides and equal contents. Contents are compared as Python
  lists up to `_LIST_LIMIT` elements (well under a microsecond for lengths), beyond that with
  `torch.equal` against a private copy; either way immune to in-place edits;
- on an accelerator: same memory viewed the same way (data pointer, shape, strides, dtype) with
  an unchanged version counter (bumped by any in-place write). The previous arguments are kept
  alive, so their memory cannot be reused by a new tensor while remembered. Inference-mode
  tensors carry no version counter: on an accelerator they are never memoised.
The memo is bypassed while torch.compile traces.

Thread safety: LMDeploy serves on its own thread while other threads may call ops. The memo's
whole state is one tuple (key, args, value), read once and replaced in one assignment, so a
thread never pairs one call's key with another call's value; two threads that race merely
compute the value twice.

It lives below the vendors (dlinfer/utils) because both the op layer and the vendors use it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

_LIST_LIMIT = 256  # CPU tensors up to this many elements are fingerprinted by their values


class _Uncacheable(Exception):
    pass


class _Contents:
    """A larger CPU tensor's contents, compared with torch.equal: the argument itself while a call
    is matched, a private copy once remembered (`frozen`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __eq__(self, other):
        return isinstance(other, _Contents) and torch.equal(self.tensor, other.tensor)

    def frozen(self) -> "_Contents":
        return _Contents(self.tensor.clone())


def _fingerprint(a):
    if not isinstance(a, torch.Tensor):
        return a
    if a.is_cpu:
        meta = (a.dtype, a.shape, a.stride())
        return (meta, a.tolist()) if a.numel() <= _LIST_LIMIT else (meta, _Contents(a))
    if a.is_inference():
        raise _Uncacheable
    return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device, a._version)


def _frozen(fp):
    """A fingerprint safe to keep: large CPU tensors replaced by private copies."""
    if isinstance(fp, tuple) and len(fp) == 2 and isinstance(fp[1], _Contents):
        return (fp[0], fp[1].frozen())
    return fp


class LastCallMemo:
    """Remembers f(*args) for the last args seen (see the module docstring for what matches)."""

    __slots__ = ("_fn", "_last")

    def __init__(self, fn: Callable):
        self._fn = fn
        self.clear()

    def clear(self) -> None:
        # (key, args, value): the args are kept alive on purpose (see the module docstring).
        self._last: Optional[Tuple[tuple, tuple, Any]] = None

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self._fn(*args)
        try:
            key = tuple(_fingerprint(a) for a in args)
        except _Uncacheable:
            return self._fn(*args)
        last = self._last  # one read: key and value always belong to the same call
        if last is not None and len(key) == len(last[0]) and all(k == r for k, r in zip(key, last[0])):
            return last[2]
        value = self._fn(*args)
        self._last = (tuple(_frozen(k) for k in key), args, value)
        return value
