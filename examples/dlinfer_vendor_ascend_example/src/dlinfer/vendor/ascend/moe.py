"""Stand-in (layout demonstration). LMDeploy 0.18's dlinfer MoE layer (`DlinferFusedMoEImpl.build_expert_storage`
and `update_weights` in backends/dlinfer/moe.py) calls these when `dlinfer.vendor.vendor_name == 'ascend'`. A real package packs experts into
its chunked storage layout; the stand-in keeps one storage slot per expert (layout None)."""

from dlinfer.vendor.ascend import CALLS


def build_chunked_moe_storage_layout(num_experts: int):
    """-> (number of physical expert slots, layout or None for the plain one-slot-per-expert)."""
    CALLS["build_chunked_moe_storage_layout"] += 1
    return num_experts, None


def chunked_moe_storage_expert_id(expert_id: int, layout) -> int:
    """Physical slot of logical expert `expert_id` under `layout`."""
    CALLS["chunked_moe_storage_expert_id"] += 1
    return expert_id


def zero_chunked_moe_weight_padding(gate_up_weights, down_weights, layout) -> None:
    """Zero the padding slots of a packed layout, in place (called when layout.packed)."""
    CALLS["zero_chunked_moe_weight_padding"] += 1
