"""The conformance suites, one module per op family (plus the cross-op ones); importing this
package registers them, in this order, in `dlinfer.conformance.checks.SUITES`, and gives the
lists of suites and checks that the runner and the tests walk."""

from typing import List

from dlinfer.conformance.checks import SUITES, Check, Suite
from dlinfer.conformance.suites import (  # noqa: F401  (registration order = run order within an op)
    activation,
    ascend_quant_rope,
    attention,
    bad_inputs,
    garbage,
    kv_cache,
    kv_int8,
    kv_int8_bad,
    moe,
    non_finite,
    non_finite_rows,
    norm,
    opcheck,
    quant,
    rotary,
    strided,
    weight_quant,
)


def all_suites() -> List[Suite]:
    """Every suite, in registration order."""
    return list(SUITES)


def checks_for(layouts, small: bool = False) -> List[Check]:
    """Every check for a vendor with these KV layouts (small: only the small ones)."""
    return [c for s in all_suites() for c in s(layouts) if c.small or not small]
