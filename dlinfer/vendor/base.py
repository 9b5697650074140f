"""The vendor protocol: what a kernel library declares to plug into dlinfer.

A vendor is a plain `Vendor` value. In-tree vendors live in `dlinfer/vendor/<name>/` and expose
`load() -> Vendor`; out-of-tree vendors register the same callable under the entry-point group
`dlinfer.vendors` (see examples/dlinfer_vendor_example and docs/vendors.md).

`Vendor.ops` maps op names (`OP_NAMES`, from the op table `dlinfer/vendor/op_table.py`) to the
vendor's functions, which take the *canonical* arguments the op table's schemas give (already
validated and normalised by `dlinfer.ops`). An op missing from a vendor's table falls back to the
torch vendor. KV-cache layouts: `dlinfer/vendor/kv_layouts.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from dlinfer.vendor.kv_layouts import HEAD_MAJOR, KV_LAYOUTS, TOKEN_MAJOR  # noqa: F401  (re-exported)
from dlinfer.vendor.op_table import OP_NAMES

# Features an op may be asked for that a vendor may lack (checked before dispatch).
FEATURE_ALIBI = "alibi_slopes"
FEATURE_KV_QUANT = "the int8 KV cache (quant_bits=8)"
FEATURE_EXPERT_PARALLEL = "expert parallelism (moe_metadata.ep_size > 1)"
FEATURE_GROUPED_ROUTER = "grouped top-k routing (moe_metadata.router_n_groups > 1)"
FEATURE_SLIDING_WINDOW = "sliding-window attention (sliding_window)"
FEATURE_SOFTCAP = "attention logit soft-capping (logit_softcapping)"


@dataclass(frozen=True)
class Capabilities:
    """What a vendor can run. `head_dims=None` means any head dim.

    The last two fields are read by `python -m dlinfer conformance` alone (docs/conformance.md),
    and shown in its report: the vendor's own tolerances for outputs compared within a tolerance,
    `op` or `(op, dtype)` -> `(atol, rtol)`, replacing dlinfer's; and the checks it declares it
    does not pass, a check-id pattern (`*` wildcards: "paged_decode_attention[*bfloat16*]"), a
    suite or an op name -> why.
    """

    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)
    head_dims: Optional[tuple] = None
    features: frozenset = frozenset({FEATURE_ALIBI})
    notes: Mapping[str, str] = field(default_factory=dict)  # op -> how it is implemented
    conformance_tolerances: Mapping = field(default_factory=dict)
    conformance_skips: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Vendor:
    """A kernel library plugged into dlinfer.

    name: what DLINFER_VENDOR / dlinfer.vendor.use() select it by.
    device_types: torch device types its kernels run on ("cpu", "cuda", "npu", ...).
    kv_layouts: supported KV-cache layouts, the first being its default.
    ops: op name -> function taking the canonical arguments.
    capabilities: dtypes, head dims, optional features.
    graph_compiler: optional `(gm: torch.fx.GraphModule, example_inputs) -> callable` used by the
        `dlinfer` torch.compile backend after dlinfer's own rewrite passes.
    repack_weight_quant: optional load-time hook `(qweight, scale, offset, group_size) ->
        (qweight', scale', offset')` for W4A16 weights in the canonical AWQ layout (already
        checked; group_size resolved, 0 -> K): what this vendor's `weight_quant_matmul` reads
        fastest, in a layout the op accepts (dlinfer/vendor/w4_layouts.py). `dlinfer.ops.
        repack_weight_quant` calls it once per layer when the framework loads the weights; without
        it the canonical tensors are used as they are.
    graph_bindings: optional op name -> `bind(*traced_args) -> callable | None`, for graph
        compilers that bind each call site once (the `direct` compiler). The arguments are the call
        site's, every one positional in the op's schema order (keywords and defaults filled in), as
        traced: FakeTensors carrying the dtype, shape and strides the graph's every call will have,
        constants as they are. `bind` returns a callable that the call site then calls with its
        arguments the same way, and that may skip the checks and choices those properties settle
        (a dtype test, a contiguity copy, which kernel), or None to keep `ops[op]`. What it skips must
        still be refused by the kernel it calls (a raise, never a misread): a replayed graph runs
        without Dynamo's guards (docs/graph.md, "Call sites bound once").
    """

    name: str
    device_types: tuple
    kv_layouts: tuple
    ops: Mapping[str, Callable]
    capabilities: Capabilities = Capabilities()
    graph_compiler: Optional[Callable] = None
    repack_weight_quant: Optional[Callable] = None
    graph_bindings: Mapping[str, Callable] = field(default_factory=dict)

    def __post_init__(self):
        bad = [layout for layout in self.kv_layouts if layout not in KV_LAYOUTS]
        if not self.kv_layouts or bad:
            raise ValueError(f"vendor {self.name!r}: kv_layouts must be a non-empty subset of {KV_LAYOUTS}")
        unknown = sorted(set(self.ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"vendor {self.name!r}: unknown ops {unknown}; known: {OP_NAMES}")
        unbound = sorted(set(self.graph_bindings) - set(self.ops))
        if unbound:
            raise ValueError(f"vendor {self.name!r}: graph_bindings for ops it does not implement: {unbound}")

    def supports(self, feature: str) -> bool:
        return feature in self.capabilities.features
