"""The vendor protocol: what a kernel library declares to plug into dlinfer.

A vendor is a plain `Vendor` value. In-tree vendors live in `dlinfer/vendor/<name>/` and expose
`load() -> Vendor`; out-of-tree vendors register the same callable under the entry-point group
`dlinfer.vendors` (see examples/dlinfer_vendor_example).

KV-cache layouts (per layer):
  TOKEN_MAJOR: key_cache [NB, BS, Hkv, D], value_cache [NB, BS, Hkv, Dv]
  HEAD_MAJOR:  key_cache [NB, Hkv, BS, D], value_cache [NB, Hkv, BS, Dv]

Op table: `ops` maps an op name (see `OP_NAMES`) to the vendor's function, which takes the
*canonical* arguments documented in `dlinfer/ops/_custom_ops.py` (already validated and
normalised by `dlinfer.ops`). An op missing from the table falls back to the torch vendor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"
KV_LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)

OP_NAMES = (
    "rms_norm",
    "add_rms_norm",
    "apply_rotary_pos_emb",
    "fill_kv_cache",
    "prefill_attention",
    "paged_prefill_attention",
    "paged_decode_attention",
    "moe_gating_topk_softmax",
    "fused_moe",
    "silu_and_mul",
    "linear",
)

# Features an op may be asked for that a vendor may lack (checked before dispatch).
FEATURE_ALIBI = "alibi_slopes"
FEATURE_KV_QUANT = "quantised KV cache (quant_bits != 0)"
FEATURE_EXPERT_PARALLEL = "expert parallelism (moe_metadata.ep_size > 1)"
FEATURE_GROUPED_ROUTER = "grouped top-k routing (moe_metadata.router_n_groups > 1)"


@dataclass(frozen=True)
class Capabilities:
    """What a vendor can run. `head_dims=None` means any head dim."""

    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)
    head_dims: Optional[tuple] = None
    features: frozenset = frozenset({FEATURE_ALIBI})
    notes: Mapping[str, str] = field(default_factory=dict)  # op -> how it is implemented


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
    """

    name: str
    device_types: tuple
    kv_layouts: tuple
    ops: Mapping[str, Callable]
    capabilities: Capabilities = Capabilities()
    graph_compiler: Optional[Callable] = None

    def __post_init__(self):
        bad = [layout for layout in self.kv_layouts if layout not in KV_LAYOUTS]
        if not self.kv_layouts or bad:
            raise ValueError(f"vendor {self.name!r}: kv_layouts must be a non-empty subset of {KV_LAYOUTS}")
        unknown = sorted(set(self.ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"vendor {self.name!r}: unknown ops {unknown}; known: {OP_NAMES}")

    def supports(self, feature: str) -> bool:
        return feature in self.capabilities.features
