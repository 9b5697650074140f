"""The direct compiler's forward runs in a data-stack chunk of its own (dlinfer/graph/backend.py,
`forward_with_own_stack_chunk`): CPython maps a new 16 KB chunk for a frame that does not fit in
the current one and unmaps it when that frame returns, so a large graph frame that ends just short
of a chunk's end used to map and unmap 16 KB on every Python call it made (a W8A8 decode step 2.3x
slower in LMDeploy's pipeline). Measured here by the process's minor page faults: a fresh mapping
faults its pages in when first written."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.fx as fx

from dlinfer.graph.backend import _STACK_CHUNK_WORDS, forward_with_own_stack_chunk

CALLS = 400  # Python calls the graph makes


@fx.wrap
def _helper(x):
    """A small Python function the graph calls (as a vendor kernel's wrapper is)."""
    return x


def _chain(x):
    for _ in range(CALLS):
        x = _helper(x)
    return x


def _graph_module() -> fx.GraphModule:
    gm = fx.symbolic_trace(_chain)
    assert sum(n.op == "call_function" for n in gm.graph.nodes) == CALLS
    return gm


def _at_depth(depth: int, fn, *args):
    """fn(*args) called under `depth` extra frames of 8 local slots each (moves where fn's frame
    starts in the data stack)."""
    if depth == 0:
        return fn(*args)
    a = b = c = d = e = f = g = h = depth  # noqa: F841 - frame size
    return _at_depth(depth - 1, fn, *args)


def _faults_per_call(forward, x, depth: int, calls: int = 20, trials: int = 3) -> float:
    """Minor page faults per call of `forward` entered at `depth`: the least of `trials` means (a
    cost every call pays stays in the least; a one-off, such as the allocator taking a new arena,
    does not)."""
    _at_depth(depth, forward, x)  # warm
    best = float("inf")
    for _ in range(trials):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            _at_depth(depth, forward, x)
        best = min(best, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls)
    return best


def test_the_forward_frame_is_larger_than_a_chunk_and_computes_the_same():
    gm = _graph_module()
    forward = forward_with_own_stack_chunk(gm)
    code = forward.__func__.__code__
    assert code.co_nlocals + code.co_stacksize > _STACK_CHUNK_WORDS
    x = torch.arange(4.0)
    assert forward(x) is x and gm(x) is x


def test_no_depth_maps_a_chunk_per_call():
    """At every depth over more than a chunk's span, a call of the padded forward faults a few
    pages (its own chunk), never one or more per Python call it makes. The unpadded forward, at
    some depth in that span, faults at least once per call it makes (the bug this guards)."""
    x = torch.zeros(1)
    gm = _graph_module()
    padded, plain = forward_with_own_stack_chunk(gm), gm.forward
    depths = range(0, 2 * _STACK_CHUNK_WORDS // 12)  # a frame of ~12 words per depth: 2 chunks' span
    worst_padded = max(_faults_per_call(padded, x, d) for d in depths)
    assert worst_padded < CALLS / 10, worst_padded
    worst_plain = max(_faults_per_call(plain, x, d) for d in depths)
    if worst_plain < CALLS / 2:
        pytest.skip(f"this Python does not map a chunk per call at any depth ({worst_plain} faults per call)")
