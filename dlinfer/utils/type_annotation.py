"""Types LMDeploy 0.18 imports from dlinfer (`lmdeploy/pytorch/kernels/dlinfer/fused_moe.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

import torch


class MoECommType(Enum):
    """How MoE tokens travel between expert-parallel ranks (Ascend names)."""

    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"
    MC2 = "mc2"


@dataclass
class MoeMetadata:
    """Per-step MoE context LMDeploy's ascend backend builds (`update_step_context`).

    Single-device MoE needs none of it (LMDeploy passes None); ep_size > 1 asks for expert
    parallelism, which the in-tree vendors do not implement (UnsupportedError).
    """

    max_tokens_across_dp: int = 1
    pad_size: int = 0
    dp_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    tp_rank: int = 0
    ep_rank: int = 0
    tp_group: Any = None
    ep_group: Any = None
    moe_comm_type: Optional[MoECommType] = None
    x_active_mask: Optional[torch.Tensor] = None
    moe_group_name: Optional[str] = None
    expert_ids_per_ep_rank: Optional[torch.Tensor] = None
    router_n_groups: int = -1
