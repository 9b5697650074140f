"""view_chains pass: view chains over dense memory become one view or none; results, aliasing and
copies are unchanged."""

import torch

from dlinfer.graph.passes.view_chains import _is_view_call

from .helpers import (
    DlinferLlamaStack,
    assert_graph_matches_eager,
    assert_same,
    capture,
    clone_caches,
    decode_inputs,
    rewrite,
    run_graph,
)


def _views(gm) -> int:
    return sum(_is_view_call(n) for n in gm.graph.nodes)


def _check(fn, *args):
    """Capture fn, run the pass, and compare outputs and the (possibly written) inputs with eager."""
    gm, inputs = capture(fn, *[a.clone() for a in args])
    before = _views(gm)
    removed = rewrite(gm, "view_chains")["view_chains"]
    assert removed == before - _views(gm)
    assert_graph_matches_eager(gm, fn, args)
    return gm, removed


def test_identity_chain_disappears():
    def f(x, w):
        y = x.view(1, 1, 8).reshape(1, 8)  # back to x's shape: no call left
        s = w.reshape(8)                    # already [8]
        return y * s

    gm, removed = _check(f, torch.randn(1, 8), torch.randn(8))
    assert removed == 3 and _views(gm) == 0, gm.code


def test_chain_becomes_one_view():
    def f(x):
        return x.view(2, 3, 4).flatten(0, 1).unflatten(-1, (2, 2)).reshape(6, 4) + 1

    gm, removed = _check(f, torch.randn(24))
    assert _views(gm) == 1 and removed == 3, gm.code


def test_writes_through_a_collapsed_view_reach_the_root():
    def f(x):
        y = x.view(4, 4).view(16)  # identity: y is x
        y.mul_(2)
        z = x.view(2, 8).reshape(4, 4)
        z[0].fill_(7.0)
        return x.sum()

    _check(f, torch.randn(16))


def test_reshape_that_copies_is_kept():
    """x.t() is not contiguous: its reshape copies, and writing the copy must not reach x."""
    def f(x):
        y = x.t().reshape(-1).view(4, 3)
        y.add_(1)
        return x * 1, y

    gm, removed = _check(f, torch.randn(3, 4))
    assert removed == 0, gm.code


def test_narrowing_slice_and_dtype_view_are_kept():
    def f(x):
        a = x[:2].reshape(-1) + x[1:].reshape(-1)[:8]  # dense slices of fewer rows are not the root
        b = x.view(torch.int32).view(-1)  # another dtype
        return a * 2, b + 1

    gm, _ = _check(f, torch.randn(3, 4))
    assert any(n.target == "view" and torch.int32 in n.args for n in gm.graph.nodes), gm.code


def test_full_slice_is_the_root():
    def f(x):
        return x[..., :4].view(12) * 2  # selects everything: one view of x

    gm, _ = _check(f, torch.randn(3, 4))
    assert _views(gm) == 1, gm.code


def test_llama_stack_decode_unchanged():
    """A dlinfer Llama stack's decode step: identical outputs and caches with the pass, fewer views."""
    stack = DlinferLlamaStack(layers=2).eval()
    x, cos, sin, caches, meta = decode_inputs([5, 9, 2], layers=2)
    gm, inputs = capture(stack, x, cos, sin, clone_caches(caches), meta)
    fresh = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    before = run_graph(gm, fresh)
    views = _views(gm)
    assert rewrite(gm, "view_chains")["view_chains"] > 0
    assert _views(gm) < views
    again = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    assert_same(run_graph(gm, again), before)
    assert_same([t for t in again if isinstance(t, torch.Tensor)],
                [t for t in fresh if isinstance(t, torch.Tensor)], what="inputs (caches) after the call")
