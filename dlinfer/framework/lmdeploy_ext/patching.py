"""Idempotent attribute replacement: the one mechanism every patch uses.

`wrap(owner, name, make)` sets `owner.name = make(original)` once. The replacement carries the
original under `__dlinfer_original__`, so a second call (a second import, `importlib.reload`)
sees the mark and does nothing: patches never stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARK = "__dlinfer_original__"


def is_patched(obj: Any) -> bool:
    """Whether `obj` is a replacement installed by `wrap`."""
    return _MARK in getattr(obj, "__dict__", {})


def original_of(obj: Any) -> Any:
    """The object a replacement stands in for (`obj` itself when it is no replacement)."""
    return obj.__dict__[_MARK] if is_patched(obj) else obj


def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> bool:
    """Replace `owner.<name>` by `make(original)` unless dlinfer already did; True if replaced.

    owner: a module or a class. The replacement must accept attribute assignment (a function,
    or an object with a `__dict__`).
    """
    current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if is_patched(current):
        return False
    replacement = make(current)
    replacement.__dict__[_MARK] = current
    setattr(owner, name, replacement)
    return True
