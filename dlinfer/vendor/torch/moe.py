"""MoE router and expert MLP in PyTorch."""

import torch
import torch.nn.functional as F
from torch import Tensor

from dlinfer.vendor.torch.linear import linear


def moe_gating_topk_softmax(router_logits: Tensor, topk: int):
    """[T, E] -> (weights [T, K] f32, ids [T, K] i64); a stable sort puts ties on the lower id."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return weights[:, :topk].contiguous(), ids[:, :topk].contiguous()


def expert_order(flat_ids, num_experts: int):
    """(order, counts): the (token, expert) pairs sorted by expert (stable) and the pairs per expert
    [0, E). Ids outside [0, E) are keyed E, so they sort last and no expert runs them: they add
    nothing, as on the cpu and triton vendors (value checks on reject them in the op layer); one
    bincount, whose `tolist` is the only sync."""
    keyed = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, num_experts)
    return torch.argsort(keyed, stable=True), torch.bincount(keyed, minlength=num_experts + 1).tolist()[:num_experts]


def fused_moe(hidden_states: Tensor, gate_up_weights: Tensor, down_weights: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, renormalize: bool) -> Tensor:
    """hidden [T, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [T, K] -> [T, H].

    The T*K (token, expert) pairs are sorted by expert; each active expert runs one gate/up GEMM,
    SiLU-and-mul and one down GEMM over its tokens; results are combined in fp32.
    """
    t, k = topk_ids.shape
    num_experts, two_i, _ = gate_up_weights.shape
    inter = two_i // 2
    weights = topk_weights.float()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat_ids = topk_ids.reshape(-1).long()
    order, counts = expert_order(flat_ids, num_experts)
    flat_weights = weights.reshape(-1)
    out = torch.zeros(t, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // k
        gate_up = linear(hidden_states[tokens], gate_up_weights[expert], None)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = linear(act, down_weights[expert], None)
        out.index_add_(0, tokens, y.float() * flat_weights[pairs].unsqueeze(1))
    return out.to(hidden_states.dtype)
