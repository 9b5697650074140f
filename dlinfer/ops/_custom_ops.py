"""The ops as torch custom ops (`torch.ops.dlinfer.<name>`), registered from the op table.

Each entry of `dlinfer/vendor/op_table.py` becomes one custom op with the entry's schema, its
in-place arguments and its fake implementation; the op's kernel is the active vendor's function
for the first argument's device. Under torch.compile the public functions of `dlinfer.ops` call
these, so Dynamo records each op as one graph node; eagerly they call the vendor function
directly (no dispatcher cost). Importing this module registers the ops and patches nothing.
"""

from __future__ import annotations

from typing import Callable

import torch

from dlinfer.vendor.op_table import NAMESPACE, OPS, OpSpec
from dlinfer.vendor.selection import resolve


def _kernel(name: str) -> Callable:
    def run(first, *rest):
        return resolve(name, first.device.type)[0](first, *rest)

    run.__name__ = name
    return run


def _register(spec: OpSpec) -> None:
    op = torch.library.custom_op(f"{NAMESPACE}::{spec.name}", _kernel(spec.name), mutates_args=spec.mutates,
                                 schema=spec.schema)
    op.register_fake(spec.fake)


for _spec in OPS.values():
    _register(_spec)
