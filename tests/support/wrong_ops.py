"""A vendor whose one op is wrong (every result scaled by 1.01): what the op tools must catch."""

from __future__ import annotations

from dlinfer.vendor import registry
from dlinfer.vendor.base import HEAD_MAJOR, TOKEN_MAJOR, Vendor
from dlinfer.vendor.op_table import OPS


def perturbed(op: str, fn):
    """fn with every result and in-place output (not caches) scaled by 1.01: a wrong kernel."""

    def wrong(*args):
        result = fn(*args)
        if op in ("paged_decode_attention", "paged_prefill_attention", "prefill_attention"):
            args[OPS[op].arg_names.index("out")].mul_(1.01)
        if isinstance(result, tuple):
            return tuple(r * 1.01 if r.is_floating_point() else r for r in result)
        return None if result is None else result * 1.01

    return wrong


def wrong_vendor(bad_op: str, name: str = "wrong", kv_layouts=(TOKEN_MAJOR, HEAD_MAJOR)) -> Vendor:
    """The torch vendor's table with `bad_op` perturbed (none if empty), as a vendor named `name`."""
    table = dict(registry.load("torch").ops)
    if bad_op:
        table[bad_op] = perturbed(bad_op, table[bad_op])
    return Vendor(name=name, device_types=("cpu",), kv_layouts=kv_layouts, ops=table)
