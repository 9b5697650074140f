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


def _kernel(spec: OpSpec) -> Callable:
    """The vendor's function for the op, called as the eager path calls it: the op's optional
    features (`OpSpec.options`, the schema's last arguments, which the dispatcher passes only up
    to the last one given) go as keywords, and only when set."""
    name = spec.name
    if not spec.options:
        def run(first, *rest):
            return resolve(name, first.device.type)[0](first, *rest)
        run.__name__ = name
        return run
    names = spec.arg_names
    fixed = len(names) - len(spec.options)

    def run(first, *rest, **named):
        args = (first, *rest)
        options = {**dict(zip(names[fixed:], args[fixed:])), **named}
        kwargs = {key: value for key, value in options.items() if value}
        return resolve(name, first.device.type)[0](*args[:fixed], **kwargs)

    run.__name__ = name
    return run


def _register(spec: OpSpec) -> None:
    op = torch.library.custom_op(f"{NAMESPACE}::{spec.name}", _kernel(spec), mutates_args=spec.mutates,
                                 schema=spec.schema)
    op.register_fake(spec.fake)


for _spec in OPS.values():
    _register(_spec)
