"""Shared pieces of the graph tests: Dynamo graph capture, node counting, a Llama layer built from
dlinfer ops with its paged-cache decode inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.fx as fx

import dlinfer.ops as ops
from dlinfer.graph import match, passes
from dlinfer.vendor.op_table import OP_NAMES


def capture(fn, *args) -> Tuple[fx.GraphModule, List]:
    """Dynamo's FX graph of fn(*args) (fullgraph) and the example inputs it was captured with."""
    got = {}

    def backend(gm, example_inputs):
        got["gm"], got["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return got["gm"], got["inputs"]


def count(gm: fx.GraphModule, name: str) -> int:
    """Nodes computing the canonical op `name` (see dlinfer.graph.match._OPS), however spelled."""
    return sum(match.is_op(n, name) for n in gm.graph.nodes)


def dl_count(gm: fx.GraphModule, name: str = None) -> int:
    return sum(match.is_dlinfer_op(n, name) for n in gm.graph.nodes)


def dl_counts(gm: fx.GraphModule) -> Dict[str, int]:
    return {name: dl_count(gm, name) for name in OP_NAMES if dl_count(gm, name)}


def rewrite(gm: fx.GraphModule, *names: str) -> Dict[str, int]:
    return passes.run(gm, list(names))


def run_graph(gm: fx.GraphModule, inputs):
    """gm(*inputs) with dlinfer ops on the torch vendor.

    The rewrite-pass tests compare a graph before and after a pass bitwise: the torch vendor
    implements each fused op with the very eager kernels of the unfused pattern (torch.rms_norm,
    F.silu, ...), so any difference is the pass's. Other vendors differ from those kernels in
    summation order or vector-tail handling by an ulp; their numerics are the parity suite's
    (tests/ops, against float64).
    """
    import dlinfer.vendor

    with torch.inference_mode(), dlinfer.vendor.using("torch"):
        out = gm(*inputs)
    return out


def flat(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flat(o)] if isinstance(out, (list, tuple)) else []


def assert_graph_matches_eager(gm: fx.GraphModule, fn, args):
    """Run gm and fn on separate clones of args: equal outputs, and equal inputs after the call
    (what either wrote in place). Returns gm's outputs."""
    eager_args = [a.clone() for a in args]
    expected = fn(*eager_args)
    graph_args = [a.clone() for a in args]
    got = run_graph(gm, graph_args)
    assert_same(got, expected)
    assert_same(graph_args, eager_args, what="inputs after the call")
    return got


def assert_same(got, expected, atol=0.0, rtol=0.0, what="output"):
    got, expected = flat(got), flat(expected)
    assert len(got) == len(expected), f"{what}: {len(got)} tensors, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, f"{what}[{i}]: {g.shape} {g.dtype} vs {e.shape} {e.dtype}"
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, msg=lambda m: f"{what}[{i}]: {m}")


# ---------------------------------------------------------------------------------------------
# A Llama decoder stack written with dlinfer ops, and decode inputs for its paged KV cache.


@dataclass
class DecodeMeta:
    block_table: torch.Tensor  # [B, M] int32
    cu_seqlens_q_cpu: torch.Tensor  # [B+1] int32 (cumulative ends, LMDeploy style)
    kv_seqlens_cpu: torch.Tensor  # [B] int32
    kv_indices: torch.Tensor  # [B] int64 slots of the new tokens
    max_kv_seq_len: int
    block_size: int


class DlinferLlamaLayer(torch.nn.Module):
    """One Llama decoder layer: every compute step a dlinfer op (as LMDeploy's dlinfer layers do)."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, eps=1e-6, seed=0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        g = torch.Generator().manual_seed(seed)

        def p(*shape, scale=0.08):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale, requires_grad=False)

        self.qkv = p((heads + 2 * kv_heads) * head_dim, hidden)
        self.o = p(hidden, heads * head_dim)
        self.gate_up = p(2 * inter, hidden)
        self.down = p(hidden, inter)
        self.norm1 = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g), requires_grad=False)
        self.norm2 = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g), requires_grad=False)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta: DecodeMeta):
        if residual is None:
            h, residual = ops.rms_norm(x, self.norm1, self.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, self.norm1, self.eps)
        q, k, v = ops.linear(h, self.qkv).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        q = q.unflatten(-1, (self.heads, self.head_dim))
        k = k.unflatten(-1, (self.kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        q, k = ops.apply_rotary_pos_emb(q, k, cos, sin)
        ops.fill_kv_cache(k, v, k_cache, v_cache, meta.kv_indices)
        attn = ops.paged_decode_attention(
            q, k_cache, v_cache, meta.block_table, meta.block_size, meta.cu_seqlens_q_cpu[1:], meta.kv_seqlens_cpu,
            meta.max_kv_seq_len, self.heads, self.kv_heads, attn_output=q[..., : self.head_dim])
        x = ops.linear(attn.flatten(-2), self.o)
        h, residual = ops.add_rms_norm(x, residual, self.norm2, self.eps)
        x = ops.linear(ops.silu_and_mul(ops.linear(h, self.gate_up)), self.down)
        return x, residual


class DlinferLlamaStack(torch.nn.Module):
    def __init__(self, layers=2, **kw):
        super().__init__()
        self.layers = torch.nn.ModuleList(DlinferLlamaLayer(seed=i, **kw) for i in range(layers))

    def forward(self, x, cos, sin, caches, meta: DecodeMeta):
        residual = None
        for layer, (kc, vc) in zip(self.layers, caches):
            x, residual = layer(x, residual, cos, sin, kc, vc, meta)
        return x + residual


def decode_inputs(kv_lens, hidden=64, head_dim=16, kv_heads=2, layers=2, block_size=4, num_blocks=32, seed=1):
    """Inputs of one decode step: sequence b has kv_lens[b] tokens, its newest not yet cached.

    Each sequence gets scattered blocks (reversed order) so that block tables matter."""
    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    max_blocks = max((n + block_size - 1) // block_size for n in kv_lens)
    ids = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    kv = torch.tensor(kv_lens, dtype=torch.int32)
    last = kv.long() - 1
    slots = ids.long()[torch.arange(b), last // block_size] * block_size + last % block_size
    meta = DecodeMeta(ids, torch.arange(b + 1, dtype=torch.int32), kv, slots, int(kv.max()), block_size)
    caches = [tuple(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) for _ in range(2))
              for _ in range(layers)]
    x = torch.randn(b, hidden, generator=g)
    angle = torch.randn(b, head_dim // 2, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    return x, cos, sin, caches, meta


def swap_caches(t, old, new):
    """The graph input `t`, with a cache of `old` (by identity) replaced by the one of `new`."""
    for pair_old, pair_new in zip(old, new):
        for a, b in zip(pair_old, pair_new):
            if t is a:
                return b
    return t


def clone_caches(caches):
    return [tuple(t.clone() for t in pair) for pair in caches]
