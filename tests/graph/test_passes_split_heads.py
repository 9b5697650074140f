"""split_heads pass: a last-dim split whose pieces are each unflattened into heads becomes one
unflatten and one split over the heads dim; the views (shape, strides, offset, storage), results
and aliasing are unchanged, and anything else is left alone."""

import pytest
import torch

from .helpers import assert_graph_matches_eager, capture, rewrite, run_graph


def _calls(gm, name: str) -> int:
    return sum(n.op == "call_method" and n.target == name for n in gm.graph.nodes)


def _check(fn, *args, rewrites: int):
    gm, _ = capture(fn, *[a.clone() for a in args])
    got_rewrites = rewrite(gm, "split_heads")["split_heads"]
    assert got_rewrites == rewrites, gm.code
    got = assert_graph_matches_eager(gm, fn, args)
    return gm, got


def _qkv_heads(x):
    q, k, v = x.split((36, 12, 12), dim=-1)
    return q.unflatten(-1, (3, 12)), k.unflatten(-1, (1, 12)), v.unflatten(-1, (1, 12))


@pytest.mark.parametrize("rows", [1, 5])
def test_qkv_split_becomes_two_calls_with_the_same_views(rows):
    x = torch.randn(rows, 60)
    gm, got = _check(lambda t: tuple(h * 1 for h in _qkv_heads(t)) + _qkv_heads(t), x, rewrites=2)
    assert _calls(gm, "unflatten") == 2 and _calls(gm, "split") == 2, gm.code  # 6 unflattens before
    # the graph's own views (the last three outputs) address x's memory as the eager ones do (a
    # dim of size 1 may carry another stride: it addresses nothing)
    eager = _qkv_heads(x)
    graph = run_graph(gm, [x])[3:]
    for e, g in zip(eager, graph):
        assert (g.shape, g.storage_offset()) == (e.shape, e.storage_offset())
        def strides(t):
            return [st for st, n in zip(t.stride(), t.shape) if n > 1]

        assert strides(g) == strides(e)
        assert g.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_writes_through_a_head_reach_the_input():
    def f(x):
        q, k, v = x.split((8, 4, 4), -1)
        k.unflatten(-1, (1, 4)).mul_(3)
        return q.unflatten(-1, (2, 4)) + 1, v.unflatten(-1, (1, 4))

    _check(f, torch.randn(3, 16), rewrites=1)  # compares the input after the call with eager's


@pytest.mark.parametrize("case", ["head_dims_differ", "piece_used_elsewhere", "split_not_last_dim",
                                  "strided_last_dim", "piece_not_unflattened", "int_split_size"])
def test_other_patterns_are_left_alone(case):
    def f(x):
        if case == "strided_last_dim":
            x = x[:, ::2]
        if case == "split_not_last_dim":
            a, b = x.split((2, 2), 0)
            return a.unflatten(-1, (4, 8)), b.unflatten(-1, (4, 8))
        if case == "int_split_size":
            a, b = x.split(16, -1)
            return a.unflatten(-1, (2, 8)), b.unflatten(-1, (2, 8))
        n = x.shape[-1] // 2
        a, b = x.split((n, n), -1)
        if case == "head_dims_differ":
            return a.unflatten(-1, (2, n // 2)), b.unflatten(-1, (n // 4, 4))
        if case == "piece_used_elsewhere":
            return a.unflatten(-1, (2, n // 2)), b.unflatten(-1, (2, n // 2)), a.sum()
        return a.unflatten(-1, (2, n // 2)), b * 2  # piece_not_unflattened

    x = torch.randn(4, 64 if case == "strided_last_dim" else 32)
    gm, _ = _check(f, x, rewrites=0)
    assert _calls(gm, "split") == 1, gm.code
