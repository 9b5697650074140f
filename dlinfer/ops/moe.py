"""Mixture of experts: router softmax + top-k, and the fused expert MLP.

Each op keeps its argument checks in one `_check_<op>` function returning the vendor's function,
run eagerly or natively while torch.compile traces (dlinfer/ops/_compile_time.py). LMDeploy's MoE
metadata is an object, whose attributes a check run at compile time cannot see: the op body reads
the two that matter (`_metadata_values`) and hands them to the check.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from dlinfer.errors import InvalidArgumentError
from dlinfer.ops import _checks as C
from dlinfer.ops._compile_time import checked
from dlinfer.ops._dispatch import check_dtype, int_arg, kernel_for, require
from dlinfer.vendor.base import FEATURE_EXPERT_PARALLEL, FEATURE_GROUPED_ROUTER


def _metadata_values(moe_metadata) -> Tuple[int, int]:
    """(expert-parallel size, router groups) of LMDeploy's MoE metadata; (1, 1) for None."""
    if moe_metadata is None:
        return 1, 1
    return getattr(moe_metadata, "ep_size", 1), getattr(moe_metadata, "router_n_groups", -1) or -1


def _check_metadata(op: str, vendor, ep_size: int, router_groups: int) -> None:
    if ep_size > 1:
        require(vendor, op, FEATURE_EXPERT_PARALLEL)
    if router_groups > 1:
        require(vendor, op, FEATURE_GROUPED_ROUTER)


def _check_gating(router_logits, topk, ep_size, router_groups):
    """Checks moe_gating_topk_softmax's arguments; returns the vendor's function (`kernel_for`)."""
    op = "moe_gating_topk_softmax"
    C.tensor(op, "router_logits", router_logits, ("T", "E"), C.FLOAT_DTYPES)
    e = router_logits.shape[1]
    topk = C.integer(op, "topk", topk, 1)
    if topk > e:
        raise InvalidArgumentError(op, "topk", f"<= the number of experts {e}", str(topk))
    kernel, vendor = kernel_for(op, router_logits.device)
    _check_metadata(op, vendor, ep_size, router_groups)
    check_dtype(vendor, op, router_logits.dtype)
    return kernel


def moe_gating_topk_softmax(router_logits: Tensor, topk: int, moe_metadata=None) -> Tuple[Tensor, Tensor]:
    """Router: fp32 softmax over the E experts, then the top-k.

    router_logits: [T, E] float32/float16/bfloat16 ([1, T, E] is taken as [T, E]).
    topk: K, 1 <= K <= E.
    moe_metadata: dlinfer.utils.type_annotation.MoeMetadata or None (single device).
    Returns (weights [T, K] float32, ids [T, K] int64): descending weights, ties to the lower expert
    id, NOT renormalised.
    """
    if isinstance(router_logits, Tensor) and router_logits.dim() == 3 and router_logits.shape[0] == 1:
        router_logits = router_logits[0]
    args = (router_logits, topk, *_metadata_values(moe_metadata))
    kernel = (_check_gating(*args) if not torch.compiler.is_compiling()
              else checked("moe_gating_topk_softmax", _check_gating, *args))
    return kernel(router_logits, int_arg(topk))


def _check_routing(op: str, topk, topk_weights: Tensor, topk_ids: Tensor, t: int, dev) -> None:
    """topk_weights [T, K] float and topk_ids [T, K] int32/int64 on `dev`, K == topk >= 1."""
    topk = C.integer(op, "topk", topk, 1)
    C.tensor(op, "topk_weights", topk_weights, (t, "K"), C.FLOAT_DTYPES, dev)
    if topk_weights.shape[1] != topk:
        raise InvalidArgumentError(op, "topk", f"topk_weights' K = {topk_weights.shape[1]}", str(topk))
    C.tensor(op, "topk_ids", topk_ids, (t, topk), C.INDEX_DTYPES, dev)


def _check_experts(op: str, hidden_states, gate_up_weights, down_weights, weight_dtypes, topk, topk_weights,
                   topk_ids, ep_size):
    """What both fused MoE ops take: hidden_states [T, H] float, gate_up_weights [E, 2I, H] and
    down_weights [E, H, I] of `weight_dtypes`, the routing; returns (the vendor's function, the
    vendor, E, 2I, H)."""
    C.tensor(op, "hidden_states", hidden_states, ("T", "H"), C.FLOAT_DTYPES)
    t, h = hidden_states.shape
    dev = hidden_states.device
    C.tensor(op, "gate_up_weights", gate_up_weights, ("E", "2I", h), weight_dtypes, dev)
    e, two_i, _ = gate_up_weights.shape
    if two_i % 2:
        raise InvalidArgumentError(op, "gate_up_weights", "an even dim 1 (2I)", C.describe(gate_up_weights))
    C.tensor(op, "down_weights", down_weights, (e, h, two_i // 2), weight_dtypes, dev)
    _check_routing(op, topk, topk_weights, topk_ids, t, dev)
    kernel, vendor = kernel_for(op, dev)
    _check_metadata(op, vendor, ep_size, 1)
    check_dtype(vendor, op, hidden_states.dtype)
    return kernel, vendor, e, two_i, h


def _expert_ids_in_range(op: str, topk_ids: Tensor, e: int) -> None:
    """Every expert id in [0, E): a value check (DLINFER_CHECK_VALUES=1; a device sync)."""
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e:
            raise InvalidArgumentError(op, "topk_ids", f"ids in [0, {e})", f"ids in [{lo}, {hi}]")


def _check_fused_moe(hidden_states, gate_up_weights, down_weights, topk_weights, topk_ids, topk, ep_size,
                     chunked_layout: bool):
    """Checks fused_moe's arguments; returns the vendor's function (`kernel_for`)."""
    op = "fused_moe"
    kernel, vendor, *_ = _check_experts(op, hidden_states, gate_up_weights, down_weights, C.FLOAT_DTYPES, topk,
                                        topk_weights, topk_ids, ep_size)
    C.same_dtype(op, "gate_up_weights", gate_up_weights, hidden_states, "hidden_states")
    C.same_dtype(op, "down_weights", down_weights, hidden_states, "hidden_states")
    if chunked_layout:
        require(vendor, op, "chunked MoE weight layout")
    return kernel


def fused_moe(
    hidden_states: Tensor,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    topk: int,
    renormalize: bool,
    moe_metadata=None,
    chunked_moe_layout=None,
) -> Tensor:
    """The routed expert MLP (SwiGLU experts).

    hidden_states: [T, H].
    gate_up_weights: [E, 2I, H]: rows :I are the gate projection, rows I: the up projection.
    down_weights: [E, H, I].
    topk_weights: [T, K] (any float dtype; combined in fp32); topk_ids: [T, K] int32/int64 in [0, E);
    with value checks off an id outside it adds nothing on every in-tree vendor (an expert-parallel
    rank's foreign ids), with them on it is refused.
    topk: K.  renormalize: rescale each token's K weights to sum to 1 first.
    moe_metadata: None for single device; ep_size > 1 raises UnsupportedError.
    chunked_moe_layout: an Ascend weight-storage layout; must be None here.
    Returns a new [T, H] tensor: sum_k w[t,k] * down[e] @ (silu(gate[e] @ x) * (up[e] @ x)).
    """
    args = (hidden_states, gate_up_weights, down_weights, topk_weights, topk_ids, topk,
            _metadata_values(moe_metadata)[0], chunked_moe_layout is not None)
    kernel = (_check_fused_moe(*args) if not torch.compiler.is_compiling()
              else checked("fused_moe", _check_fused_moe, *args))
    if C.check_values_enabled():
        _expert_ids_in_range("fused_moe", topk_ids, gate_up_weights.shape[0])
    if hidden_states.shape[0] == 0:
        return hidden_states.new_empty((0, hidden_states.shape[1]))
    return kernel(hidden_states, gate_up_weights, down_weights, topk_weights, topk_ids, bool(renormalize))


def _check_expert_scales(op: str, name: str, scales, e: int, rows: int, dev) -> None:
    """Per-output-channel scales [E, rows] or [E, rows, 1], any float dtype, on `dev`."""
    if not isinstance(scales, Tensor) or tuple(scales.shape) not in ((e, rows), (e, rows, 1)):
        raise InvalidArgumentError(op, name, f"a tensor [{e}, {rows}] or [{e}, {rows}, 1]", C.describe(scales))
    C.dtype_in(op, name, scales, C.FLOAT_DTYPES)
    if scales.device != dev:
        raise InvalidArgumentError(op, name, f"device {dev}", C.describe(scales))


def _check_fused_moe_w8a8(hidden_states, gate_up_weights, gate_up_scales, down_weights, down_scales, topk_weights,
                          topk_ids, topk, ep_size):
    """Checks fused_moe_w8a8's arguments; returns the vendor's function (`kernel_for`)."""
    op = "fused_moe_w8a8"
    kernel, _, e, two_i, h = _check_experts(op, hidden_states, gate_up_weights, down_weights, (torch.int8,), topk,
                                            topk_weights, topk_ids, ep_size)
    _check_expert_scales(op, "gate_up_scales", gate_up_scales, e, two_i, hidden_states.device)
    _check_expert_scales(op, "down_scales", down_scales, e, h, hidden_states.device)
    return kernel


def fused_moe_w8a8(
    hidden_states: Tensor,
    gate_up_weights: Tensor,
    gate_up_scales: Tensor,
    down_weights: Tensor,
    down_scales: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    topk: int,
    renormalize: bool,
    moe_metadata=None,
) -> Tensor:
    """The routed expert MLP with int8 weights (W8A8, dynamic per-token activation quantisation).

    hidden_states: [T, H] float32/float16/bfloat16, not modified.
    gate_up_weights: [E, 2I, H] int8 (rows :I gate, I: up); gate_up_scales: [E, 2I] or [E, 2I, 1],
    any float dtype (LMDeploy keeps them in bfloat16 for a bfloat16 model), one per output channel.
    down_weights: [E, H, I] int8; down_scales: [E, H] or [E, H, 1].
    topk_weights: [T, K] (any float dtype; combined in fp32); topk_ids: [T, K] int32/int64 in [0, E).
    topk: K.  renormalize: rescale each token's K weights to sum to 1 first.
    moe_metadata: None for single device; ep_size > 1 raises UnsupportedError.
    Returns a new [T, H] tensor in hidden_states' dtype. Per (token, expert): x is quantised per
    token (dynamic_quant), gate_up = (xq @ Wq.T exact) * x_scale * gate_up_scales[e] in float32,
    act = silu(gate) * up in float32, quantised per token again, y = (aq @ Dq.T exact) * a_scale *
    down_scales[e]; out = sum_k w[t,k] * y in float32, rounded once to hidden_states' dtype.
    """
    args = (hidden_states, gate_up_weights, gate_up_scales, down_weights, down_scales, topk_weights, topk_ids, topk,
            _metadata_values(moe_metadata)[0])
    kernel = (_check_fused_moe_w8a8(*args) if not torch.compiler.is_compiling()
              else checked("fused_moe_w8a8", _check_fused_moe_w8a8, *args))
    e, two_i, h = gate_up_weights.shape
    if C.check_values_enabled():
        _expert_ids_in_range("fused_moe_w8a8", topk_ids, e)
    if hidden_states.shape[0] == 0:
        return hidden_states.new_empty((0, h))
    return kernel(hidden_states, gate_up_weights, gate_up_scales.reshape(e, two_i).float(), down_weights,
                  down_scales.reshape(e, h).float(), topk_weights, topk_ids, bool(renormalize))
