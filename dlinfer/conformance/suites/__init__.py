"""The conformance suites, one module per op family (plus the cross-op ones); importing this
package registers them, in this order, in `dlinfer.conformance.checks.SUITES`."""

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
