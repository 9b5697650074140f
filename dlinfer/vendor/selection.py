"""Which vendor runs an op: explicit choice, DLINFER_VENDOR, or the best in-tree vendor per device
(cpu on CPU tensors, triton on CUDA; the torch vendor where those cannot load, with a warning).

Resolution of (op, device type) -> function is cached; `use()` / `reset()` clear the cache.
An op the chosen vendor lacks (or that DLINFER_FALLBACK_OPS names) falls back to the torch vendor
with a one-time warning.

Two hooks for the layers above, which this module never imports (docs/design.md, "State"):
`set_interceptor` installs a function that wraps what `resolve` returns (the op tools,
dlinfer/tools, while one is active; None, the default, leaves the vendor's own function), and
`on_first_resolve` runs a function once, just before the next op resolves (the op layer reads the
tools' environment variables there).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

from dlinfer import envs
from dlinfer.errors import VendorError
from dlinfer.vendor import registry
from dlinfer.vendor.base import KV_LAYOUTS, Vendor

_explicit: Optional[Tuple[Vendor, str]] = None  # (vendor, kv layout) chosen by use() or the env
_env_read = False
_cache: Dict[Tuple[str, str], Tuple[Callable, Vendor]] = {}
_warned: set = set()
# interceptor(op, device_type, fn, vendor) -> what resolve returns instead of fn; None: fn itself.
_interceptor: Optional[Callable[[str, str, Callable, Vendor], Callable]] = None
_generation = 0  # bumped whenever cached resolutions become stale (see _invalidate)
_cache_lock = threading.Lock()  # taken on cache misses and invalidations only, never on a hit
_first_resolve_hooks: List[Callable[[], None]] = []
_hooks_lock = threading.Lock()


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# The in-tree vendor preferred on each device type (else the torch vendor).
_PREFERRED = {"cuda": "triton", "cpu": "cpu"}


def _default_for_device(device_type: str) -> Vendor:
    name = _PREFERRED.get(device_type)
    if name is not None:
        vendor = registry.try_load(name)
        if vendor is not None and device_type in vendor.device_types:
            return vendor
        if vendor is None and ("unavailable", name) not in _warned:
            _warned.add(("unavailable", name))
            warnings.warn(f"dlinfer: vendor {name!r} cannot load ({registry.failures().get(name)}); ops on "
                          f"{device_type} run on the torch vendor", stacklevel=3)
    return registry.load("torch")


def _check_layout(vendor: Vendor, kv_layout: Optional[str]) -> str:
    if kv_layout is None:
        return vendor.kv_layouts[0]
    if kv_layout not in KV_LAYOUTS:
        raise VendorError(f"unknown kv_layout {kv_layout!r}; known: {KV_LAYOUTS}")
    if kv_layout not in vendor.kv_layouts:
        raise VendorError(f"vendor {vendor.name!r} supports kv layouts {vendor.kv_layouts}, not {kv_layout!r}")
    return kv_layout


def _read_env() -> None:
    global _env_read, _explicit
    if _env_read:
        return
    _env_read = True
    name = envs.get("DLINFER_VENDOR")
    if name and _explicit is None:
        vendor = registry.load(name)  # a named vendor that cannot load is an error
        _explicit = (vendor, _check_layout(vendor, envs.get("DLINFER_KV_LAYOUT")))


def _invalidate() -> None:
    """Forget every resolution; one computed concurrently from older state is not cached."""
    global _generation
    with _cache_lock:
        _generation += 1
        _cache.clear()


def set_interceptor(interceptor: Optional[Callable[[str, str, Callable, Vendor], Callable]]) -> None:
    """Make `resolve` return `interceptor(op, device_type, fn, vendor)` instead of the vendor's
    `fn` (None: fn itself again). Clears the resolve cache: the next call of each op resolves anew."""
    global _interceptor
    _interceptor = interceptor
    _invalidate()


def on_first_resolve(hook: Callable[[], None]) -> None:
    """Run `hook()` once, just before the next op resolves in this process (a cache miss)."""
    with _hooks_lock:
        _first_resolve_hooks.append(hook)


def _run_first_resolve_hooks() -> None:
    # The hooks leave the list only once they ran: a second thread resolving meanwhile waits for
    # them on the lock. A hook that raises is not retried (its error reaches the op call).
    with _hooks_lock:
        hooks = list(_first_resolve_hooks)
        try:
            for hook in hooks:
                hook()
        finally:
            del _first_resolve_hooks[:len(hooks)]


def use(name: str, kv_layout: Optional[str] = None) -> Vendor:
    """Select the vendor `name` (and optionally its KV layout) for every op in this process."""
    global _explicit, _env_read
    vendor = registry.load(name)
    _explicit = (vendor, _check_layout(vendor, kv_layout))
    _env_read = True
    _invalidate()
    return vendor


@contextlib.contextmanager
def using(name: str, kv_layout: Optional[str] = None):
    """Context manager form of `use`; restores the previous selection on exit."""
    global _explicit, _env_read
    saved = (_explicit, _env_read)
    try:
        yield use(name, kv_layout)
    finally:
        _explicit, _env_read = saved
        _invalidate()


def reset() -> None:
    """Forget the selection and re-read DLINFER_VENDOR / DLINFER_FALLBACK_OPS on next use."""
    global _explicit, _env_read
    _explicit, _env_read = None, False
    _invalidate()
    _warned.clear()


def current(device_type: Optional[str] = None) -> Vendor:
    """The vendor that runs ops on tensors of `device_type` (default: cuda if present, else cpu)."""
    _read_env()
    if _explicit is not None:
        return _explicit[0]
    return _default_for_device(device_type or _default_device_type())


def kv_layout(device_type: Optional[str] = None) -> str:
    """The KV-cache layout every op expects under the current selection."""
    _read_env()
    if _explicit is not None:
        return _explicit[1]
    return current(device_type).kv_layouts[0]


def _forced_fallback() -> set:
    raw = envs.get("DLINFER_FALLBACK_OPS") or ""
    return {p.strip() for p in raw.split(",") if p.strip()}


def resolve(op: str, device_type: str) -> Tuple[Callable, Vendor]:
    """(function, vendor) that runs `op` on tensors of `device_type`."""
    key = (op, device_type)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    if _first_resolve_hooks:
        _run_first_resolve_hooks()
    generation = _generation
    vendor = current(device_type)
    forced = _forced_fallback()
    fn = vendor.ops.get(op)
    if vendor.name != "torch" and (fn is None or op in forced or "all" in forced):
        torch_vendor = registry.load("torch")
        if (vendor.name, op) not in _warned:
            _warned.add((vendor.name, op))
            why = "forced by DLINFER_FALLBACK_OPS" if fn is not None else f"vendor {vendor.name!r} lacks it"
            warnings.warn(f"dlinfer: op {op!r} falls back to the torch vendor ({why})", stacklevel=3)
        fn, vendor = torch_vendor.ops[op], torch_vendor
    if fn is None:
        raise VendorError(f"vendor {vendor.name!r} has no op {op!r}")
    interceptor = _interceptor
    if interceptor is not None:
        fn = interceptor(op, device_type, fn, vendor)
    with _cache_lock:
        if generation == _generation:  # nothing changed the selection or the interceptor meanwhile
            _cache[key] = (fn, vendor)
    return fn, vendor
