"""A graph traced with a symbolic batch, compiled per batch size (dlinfer/graph/specialize.py, the
backend's `specialize` option): one Dynamo trace serves every size, each size runs a copy with its
sizes constant, whose code, passes and call-site bindings are those of a graph traced for that
size, and whose results are the eager model's, bit for bit. Sizes not named stay symbolic."""

from __future__ import annotations

import logging

import pytest
import torch

import dlinfer.graph.backend as backend_mod
from dlinfer.graph import specialize
from dlinfer.graph.backend import dlinfer_backend
from dlinfer.vendor import registry

from .helpers import DlinferLlamaStack, clone_caches, decode_inputs

pytestmark = pytest.mark.skipif("cpu" not in registry.available(), reason="the cpu vendor does not load here")

# What the stack reads per step with a batch dim, marked dynamic; the batch sizes named to specialise.
BATCH_SOURCES = ",".join([r"L\['x'\]:0", r"L\['cos'\]:0", r"L\['sin'\]:0"] + [
    rf"L\['meta'\]\.{name}:0" for name in ("block_table", "cu_seqlens_q_cpu", "kv_seqlens_cpu", "kv_indices")])
KEPT_SOURCES = r"L\['meta'\]\.max_kv_seq_len,L\['meta'\]\.block_table:1"
BATCH_SIZES = specialize.size_pattern(BATCH_SOURCES)


@pytest.fixture(scope="module")
def stack():
    return DlinferLlamaStack(layers=2).eval()


_DIRECT = backend_mod.direct_compiler
_calling: list = []  # the Compiled whose call is running (it compiles inside its calls)


def _recording_direct(gm, example_inputs):
    forward = _DIRECT(gm, example_inputs)
    _calling[-1].codes.append(gm.code)
    _calling[-1].graphs.append(gm)
    return forward


@pytest.fixture(autouse=True)
def recording(monkeypatch):
    """The backend's direct compiler, recording what it compiles (the backend specialises a graph
    only for the direct compiler: the `compiler is direct_compiler` check sees this one too)."""
    monkeypatch.setattr(backend_mod, "direct_compiler", _recording_direct)


class Compiled:
    """A module or function (`stack`) compiled with the dlinfer backend (direct compiler), counting
    Dynamo's traces and keeping what the backend returned and every graph the direct compiler
    compiled (and its code)."""

    def __init__(self, stack, dynamic_sources: str, options: dict, size_oblivious: bool = False):
        self.traces, self.returned, self.codes, self.graphs = 0, [], [], []
        self.dynamic_sources = dynamic_sources
        self.size_oblivious = size_oblivious  # Dynamo's backed_size_oblivious: no graph of its own for a size of 1
        options = {"compiler": "direct", **options}

        def backend(gm, example_inputs):
            self.traces += 1
            out = dlinfer_backend(gm, example_inputs, options=options)
            self.returned.append(out)
            return out

        torch._dynamo.reset()
        self.fn = torch.compile(stack, backend=backend, dynamic=False, fullgraph=True)

    def __call__(self, *args):
        _calling.append(self)
        try:
            with (torch.inference_mode(), torch.compiler.config.patch(dynamic_sources=self.dynamic_sources),
                  torch.fx.experimental._config.patch(backed_size_oblivious=self.size_oblivious)):
                return self.fn(*args)
        finally:
            _calling.pop()


def _step(stack, fn, kv_lens, seed=1):
    """(fn's output, eager output, fn's caches, eager caches) of one decode step."""
    x, cos, sin, caches, meta = decode_inputs(kv_lens, seed=seed)
    mine, eager = clone_caches(caches), clone_caches(caches)
    got = fn(x, cos, sin, mine, meta)
    with torch.inference_mode():
        expected = stack(x, cos, sin, eager, meta)
    return got, expected, mine, eager


def _assert_equal(stack, fn, kv_lens, seed=1):
    got, expected, mine, eager = _step(stack, fn, kv_lens, seed)
    assert torch.equal(got, expected), kv_lens
    assert all(torch.equal(a, b) for p, q in zip(mine, eager) for a, b in zip(p, q)), kv_lens


def _bound(before: dict) -> int:
    return sum(v - before.get(k, 0) for k, v in backend_mod.stats.items() if k.startswith("bound:"))


def test_one_trace_serves_every_batch_size_each_compiled_as_if_traced_for_it(stack):
    static = Compiled(stack, KEPT_SOURCES, {})
    per_size = Compiled(stack, f"{KEPT_SOURCES},{BATCH_SOURCES}", {"specialize": BATCH_SIZES})
    bound = []
    # (block tables at least 2 wide: Dynamo specialises a size of 1)
    for kv_lens in ([3, 5, 2], [4, 9], [7, 1, 12, 3, 5], [2, 6, 8], [1, 6]):
        before = dict(backend_mod.stats)
        _assert_equal(stack, static, kv_lens)
        bound.append(_bound(before))
        before = dict(backend_mod.stats)
        _assert_equal(stack, per_size, kv_lens)
        assert _bound(before) == bound[-1], kv_lens  # every op bound on a size's first call, as when traced
    assert bound[:3] == [bound[0]] * 3 and bound[0] > 0 and bound[3:] == [0, 0]  # (sizes 3, 2 again)
    assert static.traces == 3  # one per batch size: 3, 2, 5
    assert per_size.traces == 1
    (graph,) = per_size.returned
    assert isinstance(graph, specialize.PerSizeGraph)
    # two symbols: the batch of the token rows (x, cos, sin, kv_indices) and of the sequences
    # (block table, lengths), which Dynamo finds no reason to relate
    assert graph.sizes == [(3, 3), (2, 2), (5, 5)]
    # each size's graph is the one a trace for that size gives (but for the traced graph's
    # symbolic-int inputs, which the copy keeps, unused), and computes no size as it runs
    for mine, traced in zip(per_size.graphs, static.graphs):
        assert _structure(mine) == _structure(traced)
    assert "size(" not in "".join(per_size.codes)


def test_with_size_oblivious_sizes_the_trace_serves_a_batch_of_one_too(stack):
    """Dynamo specialises a size of 1 unless told to be size-oblivious (the LMDeploy graph runner
    is, with its batch dynamic): then the trace made at batch 3 also serves batch 1, whichever comes
    first, through a copy with the batch fixed to 1 that is the graph a trace at batch 1 gives."""
    static = Compiled(stack, KEPT_SOURCES, {})
    for first in ([3, 5, 2], [4]):
        per_size = Compiled(stack, f"{KEPT_SOURCES},{BATCH_SOURCES}", {"specialize": BATCH_SIZES}, size_oblivious=True)
        for kv_lens in (first, [6], [2, 9], [4, 1, 8]):
            _assert_equal(stack, per_size, kv_lens)
        (graph,) = per_size.returned
        assert per_size.traces == 1 and sorted(graph.sizes) == [(1, 1), (2, 2), (3, 3)]
    _assert_equal(stack, static, [6])
    ones = per_size.graphs[[key[0] for key in graph.sizes].index(1)]
    assert _structure(ones) == _structure(static.graphs[0])


def _structure(gm) -> list:
    """gm's nodes but its placeholders, as (op, target, arguments), a node argument written as its
    placeholder's name or the position of the node it names (names differ between two traces)."""
    body = [n for n in gm.graph.nodes if n.op != "placeholder"]
    index = {n: i for i, n in enumerate(body)}

    def arg(a):
        return a.name if a.op == "placeholder" else index[a]

    def target(n):
        return getattr(n.target, "__qualname__", str(n.target))

    return [(n.op, target(n), str(torch.fx.node.map_arg((n.args, n.kwargs), arg))) for n in body]


def test_sizes_not_named_stay_symbolic(stack):
    """Only the batch is specialised: the block table's width and the longest KV length stay
    symbolic, so steps with longer sequences run the same copy."""
    per_size = Compiled(stack, f"{KEPT_SOURCES},{BATCH_SOURCES}", {"specialize": BATCH_SIZES})
    for seed, kv_lens in enumerate(([3, 5], [14, 2], [30, 21], [5, 3])):
        _assert_equal(stack, per_size, kv_lens, seed=seed)
    (graph,) = per_size.returned
    assert graph.sizes == [(2, 2)] and per_size.traces == 1


def test_a_graph_without_the_named_symbols_compiles_as_usual(stack):
    plain = Compiled(stack, KEPT_SOURCES, {"specialize": BATCH_SIZES})
    _assert_equal(stack, plain, [3, 5, 2])
    (graph,) = plain.returned
    assert not isinstance(graph, specialize.PerSizeGraph)


def test_a_copy_that_cannot_be_made_runs_the_traced_graph(stack, monkeypatch, caplog):
    def broken(gm, subs):
        raise RuntimeError("no copy")

    monkeypatch.setattr(specialize, "specialized", broken)
    per_size = Compiled(stack, f"{KEPT_SOURCES},{BATCH_SOURCES}", {"specialize": BATCH_SIZES})
    before = dict(backend_mod.stats)
    with caplog.at_level(logging.WARNING, logger="dlinfer.graph"):
        for kv_lens in ([3, 5, 2], [4, 9], [6, 2, 8]):
            _assert_equal(stack, per_size, kv_lens)
    assert sum("could not specialise" in r.getMessage() for r in caplog.records) == 2  # once per size
    assert len(per_size.codes) == 1  # the traced graph, compiled once
    assert _bound(before) == 0  # its call sites have symbolic shapes: none is bound


def test_fixed_symbols_match_whole_source_names(stack):
    got = {}

    def backend(gm, example_inputs):
        got["whole"] = specialize.fixed_symbols(gm, BATCH_SIZES)
        got["prefix"] = specialize.fixed_symbols(gm, r"L\['x'\]")  # a prefix of a name is not a match
        got["width"] = specialize.fixed_symbols(gm, r"L\['meta'\]\.block_table\.size\(\)\[1\]")
        return gm.forward

    torch._dynamo.reset()
    x, cos, sin, caches, meta = decode_inputs([3, 5, 2])
    with torch.inference_mode(), torch.compiler.config.patch(dynamic_sources=f"{KEPT_SOURCES},{BATCH_SOURCES}"):
        torch.compile(stack, backend=backend, dynamic=False, fullgraph=True)(x, cos, sin, caches, meta)
    assert len(got["whole"]) == 2 and got["prefix"] == [] and len(got["width"]) == 1
    assert got["width"][0][1] not in {symbol for _, symbol in got["whole"]}


def test_other_compilers_compile_the_traced_graph(stack):
    """Inductor handed a call's real inputs would fix every size, the free ones too: the option
    applies to the direct compiler only; the others (here `eager`) get the traced graph, symbolic
    sizes and all."""
    other = Compiled(stack, f"{KEPT_SOURCES},{BATCH_SOURCES}", {"specialize": BATCH_SIZES, "compiler": "eager"})
    for seed, kv_lens in enumerate(([3, 5, 2], [14, 2], [30, 21, 5, 7])):
        _assert_equal(stack, other, kv_lens, seed=seed)
    assert other.traces == 1 and not isinstance(other.returned[0], specialize.PerSizeGraph)


def test_the_option_is_known_to_the_backend():
    with pytest.raises(ValueError, match="unknown option"):
        dlinfer_backend(None, [], options={"specialise": "x"})


def test_a_size_is_compiled_once_whichever_threads_call(monkeypatch):
    """Threads calling with a size not compiled yet: one compiles it, the others wait and run it."""
    import threading
    import time

    monkeypatch.setattr(specialize, "specialized", lambda gm, subs: dict(subs))
    compiled = []

    def compile_(subs, args):
        time.sleep(0.05)  # long enough for the other threads to arrive meanwhile
        compiled.append(tuple(subs.values()))
        return lambda *a: ("ran", tuple(subs.values()), a)

    graph = specialize.PerSizeGraph(None, [(1, "s0"), (0, "s1")], compile_)
    results = []
    threads = [threading.Thread(target=lambda: results.append(graph(7, 3, "x"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiled == [(3, 7)] and graph.sizes == [(3, 7)]
    assert results == [("ran", (3, 7), (7, 3, "x"))] * 4
    assert graph(8, 3, "y") == ("ran", (3, 8), (8, 3, "y")) and compiled == [(3, 7), (3, 8)]


def test_size_pattern_names_the_dims_of_dynamic_sources():
    import re

    pattern = specialize.size_pattern(r"L\['x'\]:0,L\['meta'\]\.block_table:1")
    assert re.fullmatch(pattern, "L['x'].size()[0]") and re.fullmatch(pattern, "L['meta'].block_table.size()[1]")
    assert not re.fullmatch(pattern, "L['x'].size()[1]")
    assert not re.fullmatch(pattern, "L['meta'].block_table.size()[0]")
    with pytest.raises(ValueError, match="expected SOURCE:DIM"):
        specialize.size_pattern(r"L\['meta'\]\.max_kv_seq_len")


def test_a_norm_of_head_split_rows_keeps_one_trace_for_a_batch_of_one():
    """Qwen3's q / k norms read a head-split query [1, B, heads, D] of the fused qkv output, which
    is contiguous only at B = 1: the op layer copies it to rows while tracing (ops/norm.py, `_rows`)
    instead of asking Dynamo whether `reshape` may view it, so sizes 3 and 1 share one trace, and
    give eager mode's values."""
    from dlinfer import ops

    heads, kv_heads, dim = 4, 2, 16
    weight = torch.rand(dim) + 0.5

    def qk_norm(qkv):
        q, k, _ = qkv.unflatten(-1, (heads + 2 * kv_heads, dim)).split((heads, kv_heads, kv_heads), dim=-2)
        return ops.rms_norm(q, weight, 1e-6), ops.rms_norm(k, weight, 1e-6)

    fn = Compiled(qk_norm, r"L\['qkv'\]:1", {"specialize": specialize.size_pattern(r"L\['qkv'\]:1")},
                  size_oblivious=True)
    for batch in (3, 1, 2):
        qkv = torch.randn(1, batch, (heads + 2 * kv_heads) * dim)
        got = fn(qkv)
        expected = qk_norm(qkv)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), batch
    assert fn.traces == 1 and len(fn.graphs) == 3
