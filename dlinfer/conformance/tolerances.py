"""Tolerances of the conformance checks: the project's one tolerance table
(dlinfer/tools/tolerances.py, docs/tools.md "Tolerances": multiples of each dtype's epsilon per
op family; exact ops compared for equality), plus what a vendor declares for its hardware.

A vendor may declare its own (atol, rtol) per op or per (op, dtype)
(`Capabilities.conformance_tolerances`, docs/conformance.md); inside `declared(...)` those replace
the table's, and `used()` says which were applied.
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Optional, Tuple

import torch

from dlinfer.tools.tolerances import EPS, FAMILY, TOLERANCES  # noqa: F401  (the one table, re-exported)

_declared: Mapping = {}
_used: list = []


def tolerance(op: str, dtype: torch.dtype) -> Tuple[float, float]:
    """(atol, rtol) for op's output of the given dtype: the vendor's declared one inside
    `declared(...)` when it names (op, dtype) or op, else the table's."""
    mine = _declared.get((op, dtype), _declared.get(op)) if _declared else None
    if mine is not None:
        _used.append((op, dtype, tuple(mine)))
        return tuple(mine)
    return TOLERANCES[(dtype, FAMILY[op])]


@contextlib.contextmanager
def declared(tolerances: Optional[Mapping]):
    """Use a vendor's declared tolerances inside the block (op or (op, dtype) -> (atol, rtol))."""
    global _declared
    saved = _declared
    _declared = dict(tolerances or {})
    _used.clear()
    try:
        yield
    finally:
        _declared = saved


def used() -> list:
    """(op, dtype, (atol, rtol)) of each declared tolerance applied since `declared` was entered."""
    return list(_used)


def check_declaration(tolerances: Mapping) -> list:
    """Problems with a vendor's declared tolerances (unknown op, not a dtype, not two floats >= 0)."""
    problems = []
    for key, value in dict(tolerances or {}).items():
        op, dtype = (key if isinstance(key, tuple) and len(key) == 2 else (key, None))
        if op not in FAMILY:
            problems.append(f"{key!r}: {op!r} is not an op compared within a tolerance (known: {sorted(FAMILY)})")
        if isinstance(key, tuple) and not isinstance(dtype, torch.dtype):
            problems.append(f"{key!r}: {dtype!r} is not a torch.dtype")
        ok = (isinstance(value, (tuple, list)) and len(value) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value))
        if not ok:
            problems.append(f"{key!r}: {value!r} is not (atol, rtol), two numbers >= 0")
    return problems
