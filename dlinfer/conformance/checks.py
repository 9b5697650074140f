"""What a conformance check is, and the list of all of them.

A `Check` is one call pattern of one op with fixed inputs: its function runs the op under the
active vendor (the runner, or the test, selects it) and raises `CheckFailed` / `Mismatch`
(dlinfer/conformance/compare.py) when the result is wrong, `Skipped` when it does not apply to
the vendor. Checks come from *suites* (tests/ops/test_suites.py runs every suite's checks on every
vendor: `test_conformance[rms_norm-cpu-...]`); a suite turns the KV layouts a vendor declares into
its checks. A check's id, `suite[params]`, is the pytest id without the vendor.

Kinds: parity (float64 reference), strided (inputs whose last dim is not dense), bad_input
(InvalidArgumentError before anything is written), garbage (bad metadata with value checks off:
nothing read or written outside a tensor), opcheck (torch.library.opcheck).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, List, Optional, Tuple, Union

import torch

from dlinfer.conformance.inputs import DTYPES, dtype_name

PARITY, STRIDED, BAD_INPUT, GARBAGE, OPCHECK = "parity", "strided", "bad_input", "garbage", "opcheck"
KINDS = (PARITY, STRIDED, BAD_INPUT, GARBAGE, OPCHECK)


class Skipped(Exception):
    """Raised by a check that does not apply to the vendor (the message says why)."""


@dataclass(frozen=True)
class Check:
    suite: str
    params: str  # the pytest id without the vendor: "t1_h64-float32", "token_major-t7_kv2-float16-int32"
    op: str  # the op it grades (the summary's row)
    kind: str
    fn: Callable = field(compare=False, repr=False)  # fn(vendor: Vendor) -> None | str (a note)
    case: str = ""  # the case's own name, for the report ("t1_h64", "weight-size")
    dtype: torch.dtype = torch.float32  # the activation dtype it runs: skipped where the vendor lacks it
    layout: Optional[str] = None
    head_dim: Optional[int] = None
    feature: Union[str, Tuple[str, ...], None] = None  # optional vendor feature(s) it needs (FEATURE_ALIBI, ...)
    small: bool = True  # small enough for an interpreted vendor (triton under TRITON_INTERPRET=1)
    uses: Tuple[str, ...] = ()  # the ops it calls, when not just `op`

    @property
    def id(self) -> str:
        return f"{self.suite}[{self.params}]" if self.params else self.suite

    @property
    def ops(self) -> Tuple[str, ...]:
        return self.uses or (self.op,)


def params(*parts) -> str:
    """A check's params string: parts joined by '-', dtypes by name, None left out."""
    return "-".join(dtype_name(p) if isinstance(p, torch.dtype) else str(p) for p in parts if p is not None)


@dataclass(frozen=True)
class Suite:
    name: str
    make: Callable  # make(layouts) -> list of Check

    def __call__(self, layouts: Iterable[str]) -> List[Check]:
        return list(self.make(tuple(layouts)))


SUITES: List[Suite] = []


def parity_per_case(op: str, fn: Callable, cases) -> List[Check]:
    """One parity check of `op` per case x dtype: `fn(vendor, case=..., dtype=...)`; each case has
    an `id` and a `small` flag."""
    return [Check(op, params(case.id, dt), op, PARITY, partial(fn, case=case, dtype=dt), case=case.id, dtype=dt,
                  small=case.small) for case in cases for dt in DTYPES]


def suite(name: str):
    """Decorator: register a generator of checks (given the vendor's KV layouts) as a suite."""

    def register(make):
        s = Suite(name, make)
        SUITES.append(s)
        return s

    return register


def _glob(pattern: str) -> "re.Pattern":
    """A pattern where `*` is any text and `?` any character; everything else, brackets
    included, is literal (check ids contain brackets)."""
    return re.compile(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."))


def matches(pattern: str, check: Check) -> bool:
    """Whether a pattern names this check: `*` / `?` wildcards over the check id
    (`paged_decode_attention[*bfloat16*]`; brackets are literal), or a bare op or suite name
    (every check of that op or suite)."""
    return pattern in (check.op, check.suite) or _glob(pattern).fullmatch(check.id) is not None


def skip_reason(vendor, check: Check, capabilities: bool = True) -> Tuple[Optional[str], bool]:
    """(why the check does not run on `vendor`, whether the vendor's own declaration says so), or
    (None, False). Capability skips (an op missing from the vendor's table, a dtype, head dim or
    feature it does not declare) are left out when `capabilities` is False."""
    caps = vendor.capabilities
    for pattern, why in dict(caps.conformance_skips or {}).items():
        if matches(pattern, check):
            return f"declared by {vendor.name} ({pattern}): {why}", True
    if not capabilities:
        return None, False
    missing = [op for op in check.ops if op not in vendor.ops]
    if missing:
        return f"not in {vendor.name}'s op table (the torch vendor runs it)", False
    if check.layout is not None and check.layout not in vendor.kv_layouts:
        return f"{vendor.name} declares no KV layout {check.layout}", False
    if check.dtype not in caps.dtypes:
        return f"{vendor.name} declares no {dtype_name(check.dtype)}", False
    if check.head_dim is not None and caps.head_dims is not None and check.head_dim not in caps.head_dims:
        return f"{vendor.name} declares no head dim {check.head_dim}", False
    needed = (check.feature,) if isinstance(check.feature, str) else (check.feature or ())
    for feature in needed:
        if not vendor.supports(feature):
            return f"{vendor.name} declares no {feature}", False
    return None, False
