"""The conformance suites, one module per op family (plus the cross-op ones); importing this
package registers them, in this order, in `dlinfer.conformance.checks.SUITES`."""

from dlinfer.conformance.suites import (  # noqa: F401  (registration order = run order within an op)
    norm,
    rotary,
    kv_cache,
    attention,
    kv_int8,
    moe,
    activation,
    quant,
    weight_quant,
    ascend_quant_rope,
    strided,
    bad_inputs,
    kv_int8_bad,
    garbage,
    opcheck,
)
