"""Finding vendors: the in-tree ones and those registered under the `dlinfer.vendors` entry point."""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from typing import Callable, Dict

from dlinfer.errors import VendorError
from dlinfer.vendor.base import Vendor

ENTRY_POINT_GROUP = "dlinfer.vendors"
IN_TREE = ("torch", "cpu", "triton")  # the preference per device is decided in selection.py

_loaded: Dict[str, Vendor] = {}
_failures: Dict[str, str] = {}
# One load per vendor, even when two threads ask at once. Reentrant: a vendor's load() may load
# another vendor (e.g. the torch vendor, to reuse some of its functions) on the same thread.
_lock = threading.RLock()


def _entry_points() -> Dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_names() -> list:
    """Every vendor name dlinfer knows of, loadable or not."""
    names = list(IN_TREE)
    names += [n for n in sorted(_entry_points()) if n not in names]
    return names


def _load_uncached(name: str) -> Vendor:
    if name in IN_TREE:
        factory: Callable = importlib.import_module(f"dlinfer.vendor.{name}").load
    else:
        eps = _entry_points()
        if name not in eps:
            raise VendorError(f"no dlinfer vendor named {name!r}")
        factory = eps[name].load()
    vendor = factory() if callable(factory) else factory
    if not isinstance(vendor, Vendor):
        raise VendorError(f"vendor {name!r} loaded {type(vendor).__name__}, expected dlinfer.vendor.base.Vendor")
    if vendor.name != name:
        raise VendorError(f"vendor registered as {name!r} calls itself {vendor.name!r}")
    return vendor


def try_load(name: str):
    """The vendor, or None when it cannot load here. Either outcome is remembered for the
    process: a vendor that failed (no compiler, no Triton) is not retried at every lookup, and
    its reason is what `load`'s error and `failures()` report."""
    if name in _loaded:
        return _loaded[name]
    if name in _failures:
        return None
    with _lock:
        if name in _loaded or name in _failures:
            return _loaded.get(name)
        try:
            vendor = _load_uncached(name)
        except Exception as exc:  # a vendor's import may fail in any way: keep the reason
            _failures[name] = f"{type(exc).__name__}: {exc}"
            return None
        _loaded[name] = vendor
    return vendor


def load(name: str) -> Vendor:
    """The vendor named `name`; a VendorError listing the loadable vendors if it cannot load."""
    vendor = try_load(name)
    if vendor is None:
        why = _failures.get(name, "unknown vendor")
        raise VendorError(
            f"dlinfer vendor {name!r} cannot be loaded ({why}); vendors that load here: {available()}"
        )
    return vendor


def available() -> list:
    """Names of the vendors that load in this process."""
    return [n for n in known_names() if try_load(n) is not None]


def failures() -> Dict[str, str]:
    """Vendor name -> why it failed to load (after a load attempt)."""
    return dict(_failures)
