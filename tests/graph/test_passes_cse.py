"""cse pass: per-layer metadata derivations are merged; nothing read after a write is."""

import torch
import torch.nn.functional as F

import dlinfer.ops as ops

from .helpers import DlinferLlamaStack, assert_same, capture, clone_caches, decode_inputs, rewrite, run_graph


def _pads(gm):
    return sum(n.target in (F.pad, torch._C._nn.pad) for n in gm.graph.nodes if n.op == "call_function")


def test_llama_stack_metadata_computed_once():
    """Two layers each derive cu_seqlens from cu_seqlens_q_cpu[1:]: one derivation remains, and
    both attention calls receive the same tensor."""
    stack = DlinferLlamaStack(layers=3).eval()
    x, cos, sin, caches, meta = decode_inputs([5, 9, 2], layers=3)
    gm, inputs = capture(stack, x, cos, sin, caches, meta)
    assert _pads(gm) == 3
    before = run_graph(gm, [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
    removed = rewrite(gm, "cse")["cse"]
    assert removed >= 6 and _pads(gm) == 1  # slice, cast and pad of two layers
    attn = [n for n in gm.graph.nodes if "paged_decode_attention" in str(n.target)]
    assert len({n.args[4] for n in attn}) == 1  # one cu_seqlens tensor for every layer
    assert_same(run_graph(gm, inputs), before)


def test_written_inputs_are_not_merged():
    def f(x, y, k_cache, v_cache, slots):
        a = x[1:].to(torch.int32)
        x.add_(1)  # x is written: the second derivation must see the new values
        b = x[1:].to(torch.int32)
        c0 = k_cache[0] * 2
        ops.fill_kv_cache(y[:, None, :4], y[:, None, 4:], k_cache, v_cache, slots)
        c1 = k_cache[0] * 2  # after the cache write
        return a, b, c0, c1

    x = torch.arange(6.0)
    y = torch.randn(2, 8)
    k, v = torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4)
    slots = torch.tensor([0, 1])
    args = [x.clone(), y, k.clone(), v.clone(), slots]
    fresh = {id(a): a0 for a, a0 in zip(args, [x, y, k, v, slots])}  # capture runs f: x, k are written
    gm, inputs = capture(f, *args)
    removed = rewrite(gm, "cse")["cse"]
    assert removed == 0, gm.code
    out = run_graph(gm, [fresh[id(t)].clone() for t in inputs])  # graph inputs in Dynamo's order
    assert_same(out, f(x.clone(), y, k.clone(), v.clone(), slots))


def test_activations_are_not_merged():
    """Values computed by non-allowlisted ops are never merged, even when identical."""

    def f(x):
        return torch.sin(x) + 1, torch.sin(x) + 1

    gm, _ = capture(f, torch.randn(4))
    assert rewrite(gm, "cse")["cse"] == 0


def test_switchable_with_the_other_passes():
    stack = DlinferLlamaStack(layers=2).eval()
    x, cos, sin, caches, meta = decode_inputs([3, 4], layers=2)
    gm, _ = capture(stack, x, cos, sin, clone_caches(caches), meta)
    assert rewrite(gm, "rms_norm") == {"rms_norm": 0} and _pads(gm) == 2
