"""The ops' argument checks while torch.compile traces (dlinfer/ops/_compile_time.py): they run
natively, not through Dynamo's bytecode interpreter, and a bad argument is still refused with the
check's own message, with and without fullgraph, for static and dynamic shapes."""

import collections
import os

import pytest
import torch

import dlinfer.ops as ops
import dlinfer.vendor as dlinfer_vendor
from dlinfer.errors import InvalidArgumentError, UnsupportedError
from dlinfer.ops import _checks as C


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _norm(x, w):
    return ops.rms_norm(x, w, 1e-6)


def _linear(x, w):
    return ops.linear(x, w)


def _eager_error(fn, *args) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        fn(*args)
    return str(info.value)


BAD_CALLS = [
    pytest.param(_norm, lambda: (torch.randn(4, 64), torch.randn(32)), id="rms_norm-weight-size"),
    pytest.param(_norm, lambda: (torch.randn(4, 64), [1.0] * 64), id="rms_norm-weight-not-a-tensor"),
    pytest.param(_norm, lambda: (torch.randn(4, 64, dtype=torch.float64), torch.randn(64)), id="rms_norm-x-dtype"),
    pytest.param(_linear, lambda: (torch.randn(4, 64), torch.randn(8, 64, dtype=torch.bfloat16)),
                 id="linear-same-dtype"),
    pytest.param(_linear, lambda: (torch.randn(4, 64), torch.randn(8, 32)), id="linear-k"),
]


@pytest.mark.parametrize("fn, make", BAD_CALLS)
def test_without_fullgraph_the_compiled_call_raises_the_eager_error(fn, make):
    args = make()
    expected = _eager_error(fn, *args)
    with pytest.raises(InvalidArgumentError) as info:
        torch.compile(fn, backend="eager")(*args)
    assert str(info.value) == expected


@pytest.mark.parametrize("fn, make", BAD_CALLS)
def test_with_fullgraph_the_compile_error_carries_the_checks_message(fn, make):
    args = make()
    expected = _eager_error(fn, *args)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(fn, backend="eager", fullgraph=True)(*args)
    assert expected in str(info.value)


class _NotATensor:
    pass


def test_an_argument_with_no_compile_time_value_is_refused_by_its_type():
    """A user object reaches the native check as a stand-in naming its type (it has no value
    Dynamo can hand over): refused like any non-tensor, with fullgraph and without."""
    x, w = torch.randn(4, 64), _NotATensor()
    refused = r"argument 'weight': expected a tensor \[64\], got _NotATensor"
    with pytest.raises(torch._dynamo.exc.Unsupported, match=refused):
        torch.compile(_norm, backend="eager", fullgraph=True)(x, w)
    torch._dynamo.reset()
    with pytest.raises(InvalidArgumentError, match=refused + " <"):
        torch.compile(_norm, backend="eager")(x, w)


def test_a_bad_size_is_refused_under_dynamic_shapes():
    x, w = torch.randn(4, 64), torch.randn(64)
    compiled = torch.compile(_norm, backend="eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x, w), _norm(x, w))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="expected size s\\d+ in dim 0 of \\[s\\d+\\]"):
        torch.compile(_norm, backend="eager", fullgraph=True, dynamic=True)(torch.randn(4, 64), torch.randn(32))


def test_symbolic_sizes_pass_through_the_checks_without_a_graph_break():
    """Under dynamic shapes the expected sizes handed to the checks are SymInts (in tuples): the
    native check reads them (no graph break, fullgraph) and the result matches eager."""
    x, w = torch.randn(5, 48), torch.randn(24, 48)
    compiled = torch.compile(_linear, backend="eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x, w), _linear(x, w))
    x, w = torch.randn(7, 40), torch.randn(16, 40)
    torch.testing.assert_close(compiled(x, w), _linear(x, w))


def _count_steps(monkeypatch) -> collections.Counter:
    """Dynamo's interpreted instructions per code object of dlinfer/ops while the test traces."""
    from torch._dynamo import symbolic_convert

    ops_dir = os.path.dirname(C.__file__)
    stepped = collections.Counter()
    real_step = symbolic_convert.InstructionTranslatorBase.step

    def step(self):
        if os.path.dirname(self.f_code.co_filename) == ops_dir:
            stepped[f"{os.path.basename(self.f_code.co_filename)}:{self.f_code.co_name}"] += 1
        return real_step(self)

    monkeypatch.setattr(symbolic_convert.InstructionTranslatorBase, "step", step)
    return stepped


def _decode_layer(x, w_qkv, w_o, g, cos, sin, key_cache, value_cache, slots, block_table, q_lens, kv_lens,
                  max_kv=32):
    h = ops.rms_norm(x, g, 1e-6)
    qkv = ops.linear(h, w_qkv)
    q, k, v = qkv[:, :64].view(-1, 4, 16), qkv[:, 64:96].view(-1, 2, 16), qkv[:, 96:].view(-1, 2, 16)
    q, k = ops.apply_rotary_pos_emb(q, k, cos, sin)
    ops.fill_kv_cache(k, v, key_cache, value_cache, slots)
    o = ops.paged_decode_attention(q, key_cache, value_cache, block_table, 16, q_lens, kv_lens, max_kv, 4, 2)
    y, r = ops.add_rms_norm(ops.linear(o.view(-1, 64), w_o), x, g, 1e-6)
    return ops.silu_and_mul(y), r


def _decode_inputs():
    from dlinfer.vendor.kv_layouts import dims

    layout = dlinfer_vendor.kv_layout("cpu")
    shape = [4 if d == "NB" else 16 if d == "BS" else d for d in dims(layout, 2, 16)]
    return (torch.randn(2, 64), torch.randn(128, 64), torch.randn(64, 64), torch.randn(64), torch.randn(2, 16),
            torch.randn(2, 16), torch.zeros(shape), torch.zeros(shape), torch.tensor([3, 20]),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
            torch.tensor([4, 5], dtype=torch.int32))


def _interpreted_checks(stepped) -> list:
    # the shared helpers (_checks.py), an op's `_check_*`, the attention ops' shared `check_*`
    checks = ("_checks.py:", "_attention_args.py:check_")
    return sorted(name for name in stepped if (name.startswith(checks) or ":_check" in name)
                  and not name.endswith(":check_values_enabled"))  # the eager-only value checks' switch


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_checks_are_not_interpreted_while_tracing_a_decode_layer(monkeypatch, dynamic):
    """A decode layer's ops compile (fullgraph) to what eager gives, and Dynamo steps through no
    instruction of their checks (`_check_*`) nor of the shared helpers (`_checks.py`; only the
    switch of the eager-only value checks, which answers False): the checks ran natively. (They
    were most of a decode graph's traced instructions.) Dynamic: every size and max_kv_seq_len
    symbolic, as the graph runner's max_kv_seq_len and block-table width are."""
    args = _decode_inputs()
    eager_args = [a.clone() for a in args]
    stepped = _count_steps(monkeypatch)
    got = torch.compile(_decode_layer, backend="eager", fullgraph=True, dynamic=dynamic)(*args, 32)
    want = _decode_layer(*eager_args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(args[6], eager_args[6])
    for op in ("linear", "rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary_pos_emb", "fill_kv_cache",
               "paged_decode_attention"):
        assert any(name.endswith(f":{op}") for name in stepped), (op, stepped)
    assert not _interpreted_checks(stepped), f"checks interpreted by Dynamo: {_interpreted_checks(stepped)}"


def _w4_weights(k=64, n=32, g=32):
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32)
    zeros = torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), dtype=torch.int32)
    return qweight, torch.rand(k // g, n) * 0.01, zeros


def _quantised_layer(x, g, w8, w8_scale, qweight, scales, zeros):
    xq, x_scale = ops.rms_norm_w8a8(x, g, 1e-6)
    y = ops.linear_w8a8(xq, w8, x_scale, w8_scale, torch.float32)
    yq, y_scale, r = ops.add_rms_norm_w8a8(y, x, g, 1e-6)
    zq, z_scale = ops.dynamic_quant(r)
    return ops.weight_quant_matmul(r, qweight, scales, zeros, group_size=32), yq, y_scale, zq, z_scale


def test_the_quantised_ops_checks_are_not_interpreted_while_tracing(monkeypatch):
    args = (torch.randn(2, 64), torch.randn(64), torch.randint(-127, 128, (64, 64), dtype=torch.int8),
            torch.rand(64) * 0.01, *_w4_weights())
    stepped = _count_steps(monkeypatch)
    got = torch.compile(_quantised_layer, backend="eager", fullgraph=True)(*args)
    for g, w in zip(got, _quantised_layer(*args)):
        torch.testing.assert_close(g, w)
    for op in ("rms_norm_w8a8", "linear_w8a8", "add_rms_norm_w8a8", "dynamic_quant", "weight_quant_matmul"):
        assert any(name.endswith(f":{op}") for name in stepped), (op, stepped)
    assert not _interpreted_checks(stepped), f"checks interpreted by Dynamo: {_interpreted_checks(stepped)}"


def _with(args, i, value):
    return args[:i] + (value,) + args[i + 1:]


class _MoeMetadata:
    """A stand-in for LMDeploy's MoE metadata object: the ops read ep_size and router_n_groups."""

    def __init__(self, ep_size=1, router_n_groups=-1):
        self.ep_size, self.router_n_groups = ep_size, router_n_groups


def _moe_layer(x, router, gate_up, down, gate_up8, gate_up8_scales, down8, down8_scales, meta):
    weights, ids = ops.moe_gating_topk_softmax(x @ router, 2, meta)
    y = ops.fused_moe(x, gate_up, down, weights, ids, 2, True, meta)
    return y + ops.fused_moe_w8a8(x, gate_up8, gate_up8_scales, down8, down8_scales, weights, ids, 2, False, meta)


def _moe_inputs(meta=None):
    e, h, i = 4, 32, 24
    return (torch.randn(3, h), torch.randn(h, e), torch.randn(e, 2 * i, h) / 8, torch.randn(e, h, i) / 8,
            torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8), torch.rand(e, 2 * i, 1) / 500,
            torch.randint(-127, 128, (e, h, i), dtype=torch.int8), torch.rand(e, h) / 500,
            _MoeMetadata() if meta is None else meta)


def _prefill(q, k, v, lens):
    return ops.prefill_attention(q, k, v, None, None, lens, lens, 5, 4, 2)


def _prefill_inputs():
    return torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16), torch.tensor([3, 5], dtype=torch.int32)


def _interleaved(x, cos, sin):
    return ops.apply_rotary_pos_emb_interleaved(x, cos, sin)


def _interleaved_inputs():
    return torch.randn(3, 6, 1, 16), torch.randn(3, 1, 1, 16), torch.randn(3, 1, 1, 16)


def _static(x, weight, scale, offset, deq_scale):
    return ops.linear_w8a8_static(x, weight, scale, offset, deq_scale, torch.float32)


def _static_inputs():
    return (torch.randn(2, 3, 32), torch.randint(-127, 128, (8, 32), dtype=torch.int8), torch.tensor([0.02]),
            torch.tensor([3], dtype=torch.int8), torch.rand(8) / 100)


@pytest.mark.parametrize("fn, make, names", [
    (_moe_layer, _moe_inputs, ("moe_gating_topk_softmax", "fused_moe", "fused_moe_w8a8")),
    (_prefill, _prefill_inputs, ("prefill_attention",)),
    (_interleaved, _interleaved_inputs, ("apply_rotary_pos_emb_interleaved",)),
    (_static, _static_inputs, ("linear_w8a8_static",)),
], ids=["moe", "prefill-attention", "interleaved-rotary", "linear-w8a8-static"])
def test_the_other_ops_checks_are_not_interpreted_while_tracing(monkeypatch, fn, make, names):
    """The router, fused_moe and fused_moe_w8a8 (LMDeploy's metadata object among the arguments),
    attention over new tokens alone, the interleaved rotary and the static W8A8 linear compile
    (fullgraph) to what eager gives, with no instruction of their checks interpreted."""
    args = make()
    stepped = _count_steps(monkeypatch)
    got = torch.compile(fn, backend="eager", fullgraph=True)(*args)
    torch.testing.assert_close(got, fn(*args))
    for op in names:
        assert any(name.endswith(f":{op}") for name in stepped), (op, stepped)
    assert not _interpreted_checks(stepped), f"checks interpreted by Dynamo: {_interpreted_checks(stepped)}"


def _bad_other_calls():
    x, router, gate_up, down, gate_up8, gate_up8_scales, down8, down8_scales, meta = _moe_inputs()
    weights, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    moe = (x, gate_up, down, weights, ids, 2, True)
    moe8 = (x, gate_up8, gate_up8_scales, down8, down8_scales, weights, ids, 2, False)
    return [
        pytest.param(ops.moe_gating_topk_softmax, (x @ router, 5), id="gating-topk-past-experts"),
        pytest.param(ops.fused_moe, _with(moe, 2, down[:, :, :20]), id="fused-moe-down-size"),
        pytest.param(ops.fused_moe, _with(moe, 5, 3), id="fused-moe-topk"),
        pytest.param(ops.fused_moe_w8a8, _with(moe8, 2, gate_up8_scales[:2]), id="fused-moe-w8a8-scales"),
        pytest.param(_prefill, _with(_prefill_inputs(), 1, torch.randn(8, 2, 8)), id="prefill-attention-key-dim"),
        pytest.param(_prefill, _with(_prefill_inputs(), 3, torch.tensor([3.0, 5.0])), id="prefill-attention-lengths"),
        pytest.param(_interleaved, (torch.randn(3, 6, 1, 15), torch.randn(3, 15), torch.randn(3, 15)),
                     id="interleaved-rotary-odd-d"),
        pytest.param(_static, _with(_static_inputs(), 4, torch.rand(7)), id="linear-w8a8-static-deq-scale"),
    ]


def _moe_refusals():
    x, router, gate_up, down, gate_up8, gate_up8_scales, down8, down8_scales, _ = _moe_inputs()
    weights, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    ep, layout = _MoeMetadata(ep_size=2), object()  # made here: Dynamo cannot trace object()
    return [
        pytest.param(lambda: ops.moe_gating_topk_softmax(x @ router, 2, _MoeMetadata(router_n_groups=2)),
                     "grouped top-k routing", id="gating-router-groups"),
        pytest.param(lambda: ops.fused_moe(x, gate_up, down, weights, ids, 2, True, ep), "expert parallelism",
                     id="fused-moe-ep"),
        pytest.param(lambda: ops.fused_moe_w8a8(x, gate_up8, gate_up8_scales, down8, down8_scales, weights, ids, 2,
                                                False, ep), "expert parallelism", id="fused-moe-w8a8-ep"),
        pytest.param(lambda: ops.fused_moe(x, gate_up, down, weights, ids, 2, True, None, layout),
                     "chunked MoE weight layout", id="fused-moe-chunked-layout"),
    ]


@pytest.mark.parametrize("call, feature", _moe_refusals())
def test_what_the_vendor_lacks_in_the_moe_metadata_is_refused_while_tracing(call, feature):
    """The metadata's ep_size and router groups (and a chunked weight layout) reach the checks
    through the op body: a vendor without them refuses under torch.compile as it does eagerly."""
    with pytest.raises(UnsupportedError) as eager:
        call()
    assert feature in str(eager.value)
    with pytest.raises(UnsupportedError) as traced:
        torch.compile(call, backend="eager")()
    assert str(traced.value) == str(eager.value)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as full:
        torch.compile(call, backend="eager", fullgraph=True)()
    assert str(eager.value) in str(full.value)


def _decode_attention(q, key_cache, value_cache, block_table, q_lens, kv_lens):
    return ops.paged_decode_attention(q, key_cache, value_cache, block_table, 16, q_lens, kv_lens, 32, 4, 2)


def _fill(k, v, key_cache, value_cache, slots):
    return ops.fill_kv_cache(k, v, key_cache, value_cache, slots)


def _bad_layer_calls():
    x, _, _, _, _, _, kc, vc, slots, table, q_lens, kv_lens = _decode_inputs()
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    attention = (q, kc, vc, table, q_lens, kv_lens)
    fill = (k, k.clone(), kc, vc, slots)
    w8a8 = (torch.randint(-127, 128, (2, 64), dtype=torch.int8), torch.randint(-127, 128, (8, 64), dtype=torch.int8),
            torch.rand(2), torch.rand(8), torch.float32)
    qweight, scales, zeros = _w4_weights()
    w4 = (x, qweight, scales, zeros)
    return [
        pytest.param(_decode_attention, _with(attention, 3, table.float()), id="decode-attention-table-dtype"),
        pytest.param(_decode_attention, _with(attention, 0, torch.randn(2, 4, 8)), id="decode-attention-head-dim"),
        pytest.param(_fill, _with(fill, 4, slots[:1]), id="fill-kv-cache-slots"),
        pytest.param(ops.linear_w8a8, _with(w8a8, 3, torch.rand(7)), id="linear-w8a8-scale"),
        pytest.param(ops.weight_quant_matmul, _with(w4, 2, scales[:, :30]), id="weight-quant-scale-n"),
    ]


@pytest.mark.parametrize("fn, args", _bad_layer_calls() + _bad_other_calls())
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks", "fullgraph"])
def test_bad_arguments_are_refused_while_tracing(fn, args, fullgraph):
    expected = _eager_error(fn, *args)
    raises = torch._dynamo.exc.Unsupported if fullgraph else InvalidArgumentError
    with pytest.raises(raises) as info:
        torch.compile(fn, backend="eager", fullgraph=fullgraph)(*args)
    assert expected in str(info.value)


def test_a_symbolic_float_argument_passes_the_native_check():
    """With dynamic shapes Dynamo holds a float argument as a SymFloat, which plain Python's
    isinstance(x, float) does not take: the check then runs interpreted, and a valid call compiles
    (fullgraph) to eager's result."""
    x, w = torch.randn(4, 64), torch.randn(64)
    compiled = torch.compile(lambda x, w, eps: ops.rms_norm(x, w, eps), backend="eager", fullgraph=True,
                             dynamic=True)
    torch.testing.assert_close(compiled(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    torch.testing.assert_close(compiled(x, w, 1e-3), ops.rms_norm(x, w, 1e-3))


class _Norm(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden), requires_grad=False)

    def forward(self, x):
        return ops.rms_norm(x, self.weight, 1e-6)


def test_non_strict_export_runs_the_checks_as_plain_python():
    """torch.export's non-strict mode compiles without Dynamo (is_compiling() is True, Dynamo is not
    tracing): the checks still run, plainly, and a good model exports with its dlinfer node."""
    exported = torch.export.export(_Norm(64), (torch.randn(4, 64),), strict=False)
    assert any("dlinfer.rms_norm" in str(node.target) for node in exported.graph.nodes)
    with pytest.raises(InvalidArgumentError, match="argument 'weight': expected size 32 in dim 0"):
        torch.export.export(_Norm(64), (torch.randn(4, 32),), strict=False)


def test_a_failed_check_is_interpreted_only_to_raise(monkeypatch):
    """The other side of the test above: a failing check does run in the trace (that is how the
    eager error is raised without fullgraph), so the counter above does see checks."""
    stepped = _count_steps(monkeypatch)
    with pytest.raises(InvalidArgumentError):
        torch.compile(_norm, backend="eager")(torch.randn(4, 64), torch.randn(32))
    assert stepped["norm.py:_check_rms_norm"] and stepped["_checks.py:tensor"], stepped


def test_a_kv_layout_switch_after_compiling_reaches_the_cache_write():
    """The KV layout stays a guarded read while tracing: after `using(..., kv_layout=...)` switches
    it, the compiled fill_kv_cache writes where eager does, even when both layouts give the caches
    the same shape (Hkv == BS), where only the layout tells them apart."""
    def fill(k, v, key_cache, value_cache, slots):
        return ops.fill_kv_cache(k, v, key_cache, value_cache, slots)

    k, v, slots = torch.randn(3, 4, 8), torch.randn(3, 4, 8), torch.tensor([1, 6, 13])
    compiled = torch.compile(fill, backend="eager", fullgraph=True)
    for layout in ("token_major", "head_major"):
        with dlinfer_vendor.using("torch", kv_layout=layout):
            got = [torch.zeros(4, 4, 4, 8) for _ in range(2)]  # [NB, BS, Hkv, D] or [NB, Hkv, BS, D]: BS = Hkv = 4
            want = [torch.zeros(4, 4, 4, 8) for _ in range(2)]
            compiled(k, v, *got, slots)
            fill(k, v, *want, slots)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
