"""Idempotent attribute replacement: the one mechanism every patch uses.

`wrap(owner, name, make)` sets `owner.name = make(original)` once. The replacement carries the
original under `__dlinfer_original__`, so a second call (a second import, `importlib.reload`)
sees the mark and does nothing: patches never stack. Every attribute a patch module asks `wrap`
for is remembered, so `applied` can tell whether its replacements are in place now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARK = "__dlinfer_original__"
_targets: dict[str, list[tuple[Any, str]]] = {}
"""Module that defines a `make` (the patch module) -> the (owner, name) it asked `wrap` to replace."""


def is_patched(obj: Any) -> bool:
    """Whether `obj` is a replacement installed by `wrap`."""
    return _MARK in getattr(obj, "__dict__", {})


def original_of(obj: Any) -> Any:
    """The object a replacement stands in for (`obj` itself when it is no replacement)."""
    return obj.__dict__[_MARK] if is_patched(obj) else obj


def _current(owner: Any, name: str) -> Any:
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> bool:
    """Replace `owner.<name>` by `make(original)` unless dlinfer already did; True if replaced.

    owner: a module or a class. The replacement must accept attribute assignment (a function,
    or an object with a `__dict__`).
    """
    targets = _targets.setdefault(getattr(make, "__module__", None) or "?", [])
    if not any(o is owner and n == name for o, n in targets):
        targets.append((owner, name))
    current = _current(owner, name)
    if is_patched(current):
        return False
    replacement = make(current)
    replacement.__dict__[_MARK] = current
    setattr(owner, name, replacement)
    return True


def applied(patch_module: str) -> tuple[int, int]:
    """(how many of the attributes `patch_module` asked `wrap` to replace are replacements now, how
    many it asked for): (0, 0) when it never called `wrap`."""
    targets = _targets.get(patch_module, [])
    return sum(_in_place(owner, name) for owner, name in targets), len(targets)


def _in_place(owner: Any, name: str) -> bool:
    try:
        return is_patched(_current(owner, name))
    except (AttributeError, KeyError):  # the attribute is gone
        return False
