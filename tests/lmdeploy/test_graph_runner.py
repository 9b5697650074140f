"""DlinferGraphRunner without an engine: padding to buckets, caches written as in eager mode,
which steps run a graph, bounded compiles, and the eager fallback of a model Dynamo cannot capture."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lmdeploy")

from lmdeploy.pytorch.backends.dlinfer.attention import DlinferAttentionMetadata  # noqa: E402

import dlinfer.ops as ops  # noqa: E402
from dlinfer.framework.lmdeploy_ext.graph_mode.runner import BATCH_SIZES, DlinferGraphRunner  # noqa: E402

H, HEADS, D, BS, NB, VOCAB = 32, 2, 16, 4, 24, 50


class TinyDecoder(torch.nn.Module):
    """Embedding, one attention layer over the paged cache (as LMDeploy's dlinfer layers call
    dlinfer.ops), an MLP. Reads attn_metadata exactly like backends/dlinfer/attention.py."""

    def __init__(self, graph_break: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ctx_mgr = None
        self.graph_break = graph_break
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, H, generator=g), requires_grad=False)
        self.qkv = torch.nn.Parameter(torch.randn(3 * HEADS * D, H, generator=g) * 0.2, requires_grad=False)
        self.o = torch.nn.Parameter(torch.randn(H, HEADS * D, generator=g) * 0.2, requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(H), requires_grad=False)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, inputs_embeds=None):
        meta = attn_metadata
        x = self.embed[input_ids[0]]  # [T, H]
        if self.graph_break:
            torch._dynamo.graph_break()
        q, k, v = ops.linear(ops.rms_norm(x, self.norm, 1e-6), self.qkv).view(-1, 3 * HEADS, D).split(HEADS, 1)
        angle = position_ids[0, :, None].float() * 0.1
        cos, sin = torch.cat([angle.cos()] * D, -1), torch.cat([angle.sin()] * D, -1)
        q, k = ops.apply_rotary_pos_emb(q, k, cos, sin)
        k_cache, v_cache = past_key_values[0]
        ops.fill_kv_cache(k, v, k_cache, v_cache, meta.kv_start_indices)
        attn = ops.paged_decode_attention(q, k_cache, v_cache, meta.block_offsets, meta.block_size,
                                          meta.cu_seqlens_q_cpu[1:], meta.kv_seqlens_cpu, meta.max_kv_seq_len,
                                          HEADS, HEADS, attn_output=q[..., :D])
        return (x + ops.linear(attn.flatten(1), self.o))[None]


def _runner(model, max_batches=4, eager_mode=False):
    cache_config = SimpleNamespace(max_batches=max_batches, cudagraph_capture_batch_sizes=None, num_gpu_blocks=NB)
    return DlinferGraphRunner(model, None, cache_config, SimpleNamespace(eager_mode=eager_mode), torch.device("cpu"))


def _step(kv_lens, seed=0, decoding=True):
    """Forward kwargs of a decode step: sequence b has kv_lens[b] tokens, its last one new."""
    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    per_seq = NB // 4
    blocks = torch.stack([torch.randperm(NB, generator=g)[:per_seq] for _ in range(b)]).to(torch.int32)
    width = max((n + BS - 1) // BS for n in kv_lens)
    blocks = blocks[:, :width].contiguous()
    kv = torch.tensor(kv_lens, dtype=torch.int32)
    last = kv.long() - 1
    slots = blocks.long()[torch.arange(b), last // BS] * BS + last % BS
    cu = torch.arange(b + 1, dtype=torch.int32)
    meta = DlinferAttentionMetadata(
        decoding, blocks, q_start_loc=cu[:-1], q_seqlens=torch.ones(b, dtype=torch.int32), kv_seqlens=kv,
        cu_seqlens_q=cu, cu_seqlens_q_cpu=cu, kv_seqlens_cpu=kv, kv_start_indices=slots, block_size=BS,
        attention_mask=(), is_prefill_no_cache=False, max_q_seqlen=1, max_kv_seq_len=int(kv.max()),
        kv_flatten_size=int(kv.sum()), quant_meta=None)
    return dict(input_ids=torch.randint(0, VOCAB, (1, b), generator=g), position_ids=(kv.long() - 1)[None],
                attn_metadata=meta, inputs_embeds=None)


def _caches(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(NB, BS, HEADS, D, generator=g) for _ in range(2))]


def _both(runner, model, step, caches):
    eager_caches = [tuple(t.clone() for t in pair) for pair in caches]
    graph_caches = [tuple(t.clone() for t in pair) for pair in caches]
    with torch.inference_mode():
        expected = model(**step, past_key_values=eager_caches)
        got = runner(**step, past_key_values=graph_caches)
    return got, expected, graph_caches, eager_caches


@pytest.fixture(scope="module", params=["dynamic", "static"])
def model_and_runner(request):
    """A model and its runner, with the batch dims dynamic (the default: one trace, compiled per
    bucket) or static (DLINFER_GRAPH_BATCH=static: one trace per bucket)."""
    torch._dynamo.reset()
    model = TinyDecoder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DLINFER_GRAPH_BATCH", request.param)
        return model, _runner(model)


def _traces(runner) -> int:
    """The graphs Dynamo traces for the runner's buckets (1, 2, 4)."""
    return len(runner.buckets) if runner.batch_mode == "static" else 1


@pytest.mark.parametrize("kv_lens", [[5, 9, 2], [6, 10, 3], [1, 16, 7], [3], [8, 2], [4, 4, 4, 4], [13, 2, 9]])
def test_padded_graph_step_equals_eager(model_and_runner, kv_lens):
    """B=3 runs padded to 4 (B=1, 2, 4 exactly): the real rows and the new tokens' cache slots
    equal eager mode's (to GEMM rounding: a 4-row GEMM may sum in another order than a 3-row
    one), and the padding rows write nothing: every other cache element is untouched."""
    model, runner = model_and_runner
    caches = _caches()
    steps = runner.graph_steps
    got, expected, graph_caches, eager_caches = _both(runner, model, _step(kv_lens, seed=len(kv_lens)), caches)
    assert runner.graph_steps == steps + 1
    assert got.shape == expected.shape == (1, len(kv_lens), H)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for before, graph, eager in zip(caches[0], graph_caches[0], eager_caches[0]):
        written = (eager != before).flatten(1).any(1)  # slots eager mode wrote
        assert int(written.sum()) == len(kv_lens)
        assert torch.equal(graph.flatten(1)[~written], before.flatten(1)[~written])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


def test_compiles_bounded_by_buckets(model_and_runner):
    """After the steps above (batch 3, 1, 2, 4; growing lengths, block tables of 1 to 4 blocks):
    one trace per bucket, or one in all with the batch dynamic."""
    _, runner = model_and_runner
    assert runner.buckets == [1, 2, 4]
    assert runner.compiles == (3 if runner.batch_mode == "static" else 1)
    assert runner.warm_buckets == {1, 2, 4} and sorted(runner._replays) == [1, 2, 4]


def test_graph_batch_option(monkeypatch):
    monkeypatch.setenv("DLINFER_GRAPH_BATCH", "Static")
    assert "input_ids" not in _runner(TinyDecoder())._dynamic_sources
    monkeypatch.setenv("DLINFER_GRAPH_BATCH", "dynamic")
    assert "input_ids" in _runner(TinyDecoder())._dynamic_sources
    monkeypatch.delenv("DLINFER_GRAPH_BATCH")
    runner = _runner(TinyDecoder())
    assert "input_ids" in runner._dynamic_sources and runner.batch_mode == "dynamic"  # the default
    assert runner._options["specialize"] == BATCH_SIZES
    monkeypatch.setenv("DLINFER_GRAPH_BATCH", "bucket")
    with pytest.raises(ValueError, match="DLINFER_GRAPH_BATCH='bucket': expected 'dynamic'"):
        _runner(TinyDecoder())


@pytest.mark.parametrize("kv_lens", [[7, 3, 12], [2], [9, 4], [5, 6, 7, 8], [14, 2, 3]])
def test_warm_steps_replay_their_bucket_graph(model_and_runner, kv_lens, monkeypatch):
    """Every bucket compiled: a step calls its bucket's graph without Dynamo (graph_mode/replay.py):
    eager mode's results and caches, no compile, the compiled model never entered."""
    model, runner = model_and_runner
    assert runner.compiles == _traces(runner) and sorted(runner._replays) == runner.buckets
    monkeypatch.setattr(runner, "_compiled_model", lambda: pytest.fail("a warm step went through Dynamo"))
    steps = runner.graph_steps
    got, expected, graph_caches, eager_caches = _both(runner, model, _step(kv_lens, seed=len(kv_lens) + 7), _caches())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graph_caches, eager_caches, atol=1e-5, rtol=1e-5)
    assert runner.compiles == _traces(runner) and runner.graph_steps == steps + 1


@pytest.mark.parametrize("kv_lens,pads", [([9, 4], False), ([5, 6, 7, 8], False), ([7, 3, 12], True), ([2], True)])
def test_a_full_bucket_replays_the_steps_own_tensors(model_and_runner, kv_lens, pads, monkeypatch):
    """A batch that fills its bucket (block table of 2 columns or more) replays on the step's own
    tensors, no copies; a partial bucket ([7, 3, 12] in 4) or a one-column table ([2]) is padded.
    Either way the results and caches are eager mode's."""
    model, runner = model_and_runner
    assert sorted(runner._replays) == runner.buckets
    calls = []
    pad = runner._pad
    monkeypatch.setattr(runner, "_pad", lambda *args: calls.append(args) or pad(*args))
    step = _step(kv_lens, seed=len(kv_lens) + 11)
    got, expected, graph_caches, eager_caches = _both(runner, model, step, _caches())
    assert bool(calls) == pads
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graph_caches, eager_caches, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_lens", [[7, 3, 12], [2], [9, 4]])
def test_warm_guards_pick_the_right_graph(model_and_runner, kv_lens, monkeypatch):
    """Without replays (a graph they cannot serve), warm steps go through Dynamo evaluating only
    the guards telling the graphs apart (skip_guard_eval_unsafe): eager mode's results."""
    model, runner = model_and_runner
    monkeypatch.setattr(runner, "_replays", {})
    stances = []
    set_stance = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: stances.append(k) or set_stance(*a, **k))
    got, expected, graph_caches, eager_caches = _both(runner, model, _step(kv_lens, seed=len(kv_lens) + 9), _caches())
    assert stances == [dict(skip_guard_eval_unsafe=True)]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graph_caches, eager_caches, atol=1e-5, rtol=1e-5)
    assert runner.compiles == _traces(runner) and not runner._replays


def test_graph_guards_option(monkeypatch):
    monkeypatch.setenv("DLINFER_GRAPH_GUARDS", "full")
    assert _runner(TinyDecoder())._all_guards
    monkeypatch.setenv("DLINFER_GRAPH_GUARDS", "some")
    with pytest.raises(ValueError, match="DLINFER_GRAPH_GUARDS='some': expected 'warm'"):
        _runner(TinyDecoder())


def test_non_decode_steps_and_oversized_batches_run_eagerly(model_and_runner):
    model, runner = model_and_runner
    compiles, steps = runner.compiles, runner.graph_steps
    for step in (_step([4, 5], decoding=False), _step([3, 4, 5, 6, 7])):  # prefill; 5 > max bucket 4
        got, expected, _, _ = _both(runner, model, step, _caches())
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert (runner.compiles, runner.graph_steps) == (compiles, steps)


def test_eager_mode_runner_never_compiles():
    model = TinyDecoder()
    runner = _runner(model, eager_mode=True)
    got, expected, _, _ = _both(runner, model, _step([3, 4]), _caches())
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert runner.compiles == 0 and runner.graph_steps == 0


def test_model_dynamo_cannot_capture_falls_back_to_eager(caplog):
    torch._dynamo.reset()
    model = TinyDecoder(graph_break=True)
    runner = _runner(model)
    with caplog.at_level("WARNING", logger="dlinfer.lmdeploy.graph"):
        got, expected, graph_caches, eager_caches = _both(runner, model, _step([3, 4]), _caches())
    assert "running eagerly" in caplog.text
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert all(torch.equal(a, b) for pg, pe in zip(graph_caches, eager_caches) for a, b in zip(pg, pe))
    got, expected, _, _ = _both(runner, model, _step([5, 2]), _caches())  # stays eager, no retry
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert runner.graph_steps == 0


class DictDecoder(TinyDecoder):
    """Returns a dict built in the forward (not one of the graph's outputs), takes **kwargs."""

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, inputs_embeds=None, **kwargs):
        out = super().forward(input_ids, position_ids, past_key_values, attn_metadata, inputs_embeds)
        return {"hidden_states": out * kwargs.get("gain", 1.0)}


def _graph_steps_through_dynamo(model, steps=3):
    """A fresh runner's `steps` decode steps of batch 2: each equals eager mode, each ran a graph,
    and no bucket got a replay."""
    torch._dynamo.reset()
    runner = _runner(model)
    for n in range(steps):
        got, expected, _, _ = _both(runner, model, _step([3 + n, 4 + n]), _caches())
        if isinstance(got, dict):
            got, expected = got["hidden_states"], expected["hidden_states"]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert runner.graph_steps == steps and not runner._replays
    return runner


def test_full_guards_never_replay(monkeypatch):
    monkeypatch.setenv("DLINFER_GRAPH_GUARDS", "full")
    _graph_steps_through_dynamo(TinyDecoder())


def test_replay_option(monkeypatch):
    monkeypatch.setenv("DLINFER_GRAPH_REPLAY", "0")
    _graph_steps_through_dynamo(TinyDecoder())
    monkeypatch.setenv("DLINFER_GRAPH_REPLAY", "yes")
    with pytest.raises(ValueError, match="DLINFER_GRAPH_REPLAY='yes': expected '1'"):
        _runner(TinyDecoder())


def test_output_the_graph_does_not_return_keeps_dynamo():
    """A forward whose result is built around the graph's outputs (a dict) is not replayed: its
    steps still go through Dynamo and equal eager mode."""
    _graph_steps_through_dynamo(DictDecoder())


def test_replay_inputs_from_var_keyword_arguments():
    """Sources under the forward's **kwargs (L['kwargs'][...]) are gathered like the others."""
    from dlinfer.framework.lmdeploy_ext.graph_mode.replay import frame_function

    frame = frame_function(DictDecoder().forward)
    got = frame(dict(input_ids=1, position_ids=2, past_key_values=3, attn_metadata=4, gain=5))
    assert got == dict(input_ids=1, position_ids=2, past_key_values=3, attn_metadata=4, inputs_embeds=None,
                       kwargs={"gain": 5})


def test_graph_inputs_not_expressible_are_refused():
    from dlinfer.framework.lmdeploy_ext.graph_mode.replay import gather_function

    gather = gather_function(["L['a'][1]", "L['b'].size()[0]"])
    assert gather({"a": [0, 7], "b": torch.zeros(3)}) == (7, 3)
    assert gather_function(["L['a']", "G['torch'].x"]) is None  # a global
    assert gather_function(["L['a']["]) is None  # not an expression
    assert gather_function(["L['a']", None]) is None  # no source at all


def test_graph_inputs_share_their_prefixes_and_are_read_afresh():
    """Prefixes two sources share are read once a call; every call still reads the current objects."""
    from dlinfer.framework.lmdeploy_ext.graph_mode.replay import gather_function

    class Reads(dict):
        count = 0

        def __getitem__(self, key):
            Reads.count += 1
            return super().__getitem__(key)

    layers = Reads({"0": {"w": 1, "b": 2}, "1": {"w": 3}})
    names = ["L['self'].layers['0']['w']", "L['self'].layers['0']['b']", "L['self'].layers['1']['w']",
             "L['x']", "L['t'].size()[0]"]
    gather = gather_function(names)

    class Model:
        pass

    model = Model()
    model.layers = layers
    frame = {"self": model, "x": 9, "t": torch.zeros(4)}
    assert gather(frame) == (1, 2, 3, 9, 4)
    assert Reads.count == 2  # layers['0'] once, layers['1'] once
    layers["0"] = {"w": 5, "b": 6}  # a swapped module, a new tensor: seen on the next call
    model.layers["1"]["w"] = 7
    assert gather(frame) == (5, 6, 7, 9, 4)
    model.layers = Reads({"0": {"w": 0, "b": 0}, "1": {"w": 0}})
    assert gather(frame)[:3] == (0, 0, 0)


class CountingDecoder(TinyDecoder):
    """Counts its forwards on itself: a Python side effect Dynamo replays after the graph."""

    calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)


def test_forward_with_python_side_effects_keeps_dynamo():
    model = CountingDecoder()
    _graph_steps_through_dynamo(model)
    assert model.calls == 6  # three eager forwards, three through Dynamo: none skipped


def test_every_bucket_shares_one_trace_compiled_per_bucket(monkeypatch):
    """The default (DLINFER_GRAPH_BATCH=dynamic): one graph traced with a dynamic batch (sizes
    size-oblivious, so a batch of 1 is no special case) that buckets 1, 2 and 4 share, compiled for
    each of them with its batch sizes fixed (dlinfer/graph/specialize.py), each bucket replaying it;
    every step eager mode's results. (Last in the file: it resets Dynamo, whose caches the module's
    runner relies on.)"""
    from dlinfer.graph.specialize import PerSizeGraph

    monkeypatch.delenv("DLINFER_GRAPH_BATCH", raising=False)
    torch._dynamo.reset()
    model = TinyDecoder()
    runner = _runner(model)
    for kv_lens in ([5, 9, 2], [3], [8, 2], [4, 4, 4, 4], [6, 1]):
        got, expected, graph_caches, eager_caches = _both(runner, model, _step(kv_lens, seed=len(kv_lens)), _caches())
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph_caches, eager_caches, atol=1e-5, rtol=1e-5)
    assert runner.compiles == 1 and runner.warm_buckets == {1, 2, 4} and sorted(runner._replays) == [1, 2, 4]
    shared = runner._replays[2]._compiled
    assert isinstance(shared, PerSizeGraph)
    assert runner._replays[4]._compiled is shared and runner._replays[1]._compiled is shared
    # the graph's inputs are gathered by one function, made once for the three buckets
    assert runner._replays[1]._gather is runner._replays[2]._gather is runner._replays[4]._gather
    assert sorted(tuple(set(key)) for key in shared.sizes) == [(1,), (2,), (4,)]  # a bucket: all its batch sizes fixed
    for kv_lens in ([7, 3, 12], [2], [9, 4, 1, 5]):  # replayed
        got, expected, graph_caches, eager_caches = _both(runner, model, _step(kv_lens, seed=len(kv_lens) + 5),
                                                          _caches())
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph_caches, eager_caches, atol=1e-5, rtol=1e-5)
    assert runner.compiles == 1 and len(shared.sizes) == 3
    torch._dynamo.reset()
