"""Call-site bindings (Vendor.graph_bindings, dlinfer/vendor/cpu/graph_bindings.py): the direct
compiler binds each dlinfer node to the kernel the vendor chooses for the node's traced arguments.
The bound graph's outputs and cache writes equal the unbound graph's bit for bit (the same kernels);
a binding is declined where the op function must choose per call; a bound kernel handed arguments
other than the traced ones raises instead of misreading them."""

from __future__ import annotations

import pytest
import torch

import dlinfer.graph.backend as backend_mod
from dlinfer.graph.backend import direct_compiler
from dlinfer.vendor import HEAD_MAJOR, TOKEN_MAJOR, Vendor, registry, resolve, selection

from .helpers import DlinferLlamaStack, capture, clone_caches, decode_inputs, dl_counts, swap_caches

pytestmark = pytest.mark.skipif("cpu" not in registry.available(), reason="the cpu vendor does not load here")


@pytest.fixture(scope="module")
def stack():
    return DlinferLlamaStack(layers=2).eval()


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _compile_and_run(stack, kv_lens, monkeypatch, bind: bool):
    """(graph module, outputs, caches written) of the stack's direct-compiled decode graph, its
    call-site bindings on or off, run on fresh copies of the inputs' caches."""
    monkeypatch.setenv("DLINFER_GRAPH_BIND", "1" if bind else "0")
    x, cos, sin, caches, meta = decode_inputs(kv_lens)
    traced = clone_caches(caches)
    gm, inputs = capture(stack, x, cos, sin, traced, meta)
    ops = dl_counts(gm)
    with torch.no_grad():  # as the dlinfer backend compiles a graph of dlinfer ops
        forward = direct_compiler(gm, inputs)
    written = clone_caches(caches)
    with torch.inference_mode():
        out = forward(*[swap_caches(t, traced, written) for t in inputs])
    return gm, ops, list(out) if isinstance(out, (list, tuple)) else [out], written, caches


@pytest.mark.parametrize("kv_lens", [[3, 5, 2], [1], [16, 1, 7, 4]])
def test_every_op_of_a_llama_stack_is_bound_and_gives_the_unbound_bits(stack, monkeypatch, kv_lens):
    gm0, ops, out0, written0, caches = _compile_and_run(stack, kv_lens, monkeypatch, bind=False)
    before = dict(backend_mod.stats)
    gm1, _, out1, written1, _ = _compile_and_run(stack, kv_lens, monkeypatch, bind=True)
    assert set(ops) == {"rms_norm", "add_rms_norm", "linear", "apply_rotary_pos_emb", "fill_kv_cache",
                        "paged_decode_attention", "silu_and_mul"}
    for op, n in ops.items():
        assert backend_mod.stats[f"bound:{op}"] - before.get(f"bound:{op}", 0) == n, op
    vendor_fns = {resolve(op, "cpu")[0] for op in ops}
    assert not vendor_fns & set(_targets(gm1)), "a node kept its op function"
    assert vendor_fns <= set(_targets(gm0))
    assert all(torch.equal(a, b) for a, b in zip(out0, out1))
    assert all(torch.equal(a, b) for p0, p1 in zip(written0, written1) for a, b in zip(p0, p1))
    assert not torch.equal(caches[0][0], written1[0][0])  # the bound graph did write the caches


def test_symbolic_shapes_and_op_tools_keep_the_op_functions(stack, monkeypatch):
    """A graph with a symbolic row count (dynamic=True), or one compiled while an op tool intercepts
    the ops (its wrapper must see every call), binds nothing."""
    monkeypatch.setenv("DLINFER_GRAPH_BIND", "1")
    x, cos, sin, caches, meta = decode_inputs([3, 5, 2])
    before = sum(v for k, v in backend_mod.stats.items() if k.startswith("bound:"))
    torch._dynamo.reset()
    compiled = torch.compile(stack, backend="dlinfer", dynamic=True, options={"compiler": "direct"})
    with torch.inference_mode():
        compiled(x, cos, sin, clone_caches(caches), meta)
    assert sum(v for k, v in backend_mod.stats.items() if k.startswith("bound:")) == before

    seen = []

    def intercept(op, device_type, fn, vendor):
        def wrapped(*args, **kwargs):
            seen.append(op)
            return fn(*args, **kwargs)
        return wrapped

    gm, inputs = capture(stack, x, cos, sin, clone_caches(caches), meta)
    selection.set_interceptor(intercept)
    try:
        with torch.no_grad():
            forward = direct_compiler(gm, inputs)
        with torch.inference_mode():
            forward(*inputs)
    finally:
        selection.set_interceptor(None)
    assert sum(v for k, v in backend_mod.stats.items() if k.startswith("bound:")) == before
    assert seen.count("linear") == 8 and seen.count("paged_decode_attention") == 2


def test_keyword_arguments_reach_a_bound_kernel_in_schema_order():
    """A node calling an op with keywords (the attention ops get sliding_window / logit_softcapping
    so, when set) is bound with every argument in the schema's order, defaults filled in."""
    import torch.fx as fx

    graph = fx.Graph()
    names = ["query", "key_cache", "value_cache", "block_table", "cu_seqlens_q", "kv_seq_len"]
    inputs = [graph.placeholder(n) for n in names]
    node = graph.call_function(torch.ops.dlinfer.paged_decode_attention,
                               (*inputs, 9, 0.25, None, inputs[0], TOKEN_MAJOR), {"sliding_window": 4})
    positional = backend_mod._positional(node)
    assert positional == [*inputs, 9, 0.25, None, inputs[0], TOKEN_MAJOR, None, None, None, None, 4, 0.0]
    node.kwargs = {"not_an_argument": 1}
    assert backend_mod._positional(node) is None

    decode, _ = _paged(torch.float32, TOKEN_MAJOR)
    vendor = _cpu()
    bound = vendor.graph_bindings["paged_decode_attention"](*decode, None, None, None, None, 4, 0.0)
    _same(bound, lambda *a: vendor.ops["paged_decode_attention"](*a[:15], sliding_window=a[15]),
          (*decode, None, None, None, None, 4, 0.0), written=(9,))
    full = decode[9].clone()
    vendor.ops["paged_decode_attention"](*decode[:9], full, *decode[10:])
    windowed = decode[9].clone()
    bound(*decode[:9], windowed, *decode[10:], None, None, None, None, 4, 0.0)
    assert not torch.equal(full, windowed)  # the window reached the kernel


def test_a_bad_switch_value_is_refused_naming_it(stack, monkeypatch):
    x, cos, sin, caches, meta = decode_inputs([2])
    gm, inputs = capture(stack, x, cos, sin, caches, meta)
    monkeypatch.setenv("DLINFER_GRAPH_BIND", "yes")
    with pytest.raises(ValueError, match="DLINFER_GRAPH_BIND='yes': expected '1'"):
        direct_compiler(gm, inputs)


def test_a_vendor_cannot_bind_an_op_it_does_not_implement():
    with pytest.raises(ValueError, match=r"graph_bindings for ops it does not implement: \['linear'\]"):
        Vendor(name="x", device_types=("cpu",), kv_layouts=(TOKEN_MAJOR,), ops={"rms_norm": lambda *a: None},
               graph_bindings={"linear": lambda *a: None})


# --- the cpu vendor's bindings, called with real tensors as examples


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _cpu():
    return registry.load("cpu")


def _same(bound, fn, args, written=()):
    """bound(*args) and fn(*args) give the same bits (outputs, and tensors written in place)."""
    copies = [[a.clone() if isinstance(a, torch.Tensor) else a for a in args] for _ in range(2)]
    outs = [f(*c) for f, c in zip((bound, fn), copies)]
    if outs[0] is not None or outs[1] is not None:
        o0 = outs[0] if isinstance(outs[0], (list, tuple)) else [outs[0]]
        o1 = outs[1] if isinstance(outs[1], (list, tuple)) else [outs[1]]
        assert all(torch.equal(a, b) for a, b in zip(o0, o1))
    for i in written:
        assert torch.equal(copies[0][i], copies[1][i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_bound_linear_and_norms_give_the_op_functions_bits(dtype, rows):
    g = _g(rows)
    x, w = torch.randn(rows, 96, generator=g).to(dtype), torch.randn(40, 96, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    vendor = _cpu()
    for bias in (None, b):
        bound = vendor.graph_bindings["linear"](x, w, bias)
        assert bound is not None
        _same(bound, vendor.ops["linear"], (x, w, bias))
    h, r = torch.randn(rows, 96, generator=g).to(dtype), torch.randn(rows, 96, generator=g).to(dtype)
    for norm_weight in (torch.rand(96, generator=g) + 0.5, (torch.rand(96, generator=g) + 0.5).to(dtype)):
        for op, args in (("rms_norm", (h, norm_weight, 1e-6)), ("add_rms_norm", (h, r, norm_weight, 1e-6)),
                         ("rms_norm_w8a8", (h, norm_weight, 1e-6)), ("add_rms_norm_w8a8", (h, r, norm_weight, 1e-6))):
            bound = vendor.graph_bindings[op](*args)
            assert bound is not None, op
            _same(bound, vendor.ops[op], args)
    q, k = torch.randn(rows, 4, 32, generator=g).to(dtype), torch.randn(rows, 2, 32, generator=g).to(dtype)
    cos, sin = torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)
    for c, s_ in ((cos, sin), (cos.to(dtype), sin.to(dtype))):
        bound = vendor.graph_bindings["apply_rotary_pos_emb"](q, k, c, s_)
        assert bound is not None
        _same(bound, vendor.ops["apply_rotary_pos_emb"], (q, k, c, s_))
    gate_up = torch.randn(rows, 64, generator=g).to(dtype)
    _same(vendor.graph_bindings["silu_and_mul"](gate_up), vendor.ops["silu_and_mul"], (gate_up,))


def _paged(dtype, layout, seqs=(5, 1, 9), hkv=2, hq=4, d=32, bs=4, nb=16, seed=3):
    g = _g(seed)
    shape = (nb, bs, hkv, d) if layout == TOKEN_MAJOR else (nb, hkv, bs, d)
    kc, vc = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    b = len(seqs)
    table = torch.randperm(nb, generator=g)[:b * 3].reshape(b, 3).to(torch.int32)
    kv_len = torch.tensor(seqs, dtype=torch.int32)
    cu = torch.arange(b + 1, dtype=torch.int32)
    q, out = torch.randn(b, hq, d, generator=g).to(dtype), torch.empty(b, hq, d, dtype=dtype)
    decode = (q, kc, vc, table, cu, kv_len, int(kv_len.max()), d ** -0.5, None, out, layout)
    key, value = torch.randn(b, hkv, d, generator=g).to(dtype), torch.randn(b, hkv, d, generator=g).to(dtype)
    slots = torch.tensor([1, 7, -1], dtype=torch.int64)[:b]
    fill = (key, value, kc, vc, slots, layout)
    return decode, fill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_cache_ops_give_the_op_functions_bits_and_head_major_stays_unbound(dtype):
    vendor = _cpu()
    decode, fill = _paged(dtype, TOKEN_MAJOR)
    bound = vendor.graph_bindings["paged_decode_attention"](*decode)
    assert bound is not None
    _same(bound, vendor.ops["paged_decode_attention"], decode, written=(9,))
    bound = vendor.graph_bindings["fill_kv_cache"](*fill)
    assert bound is not None
    _same(bound, vendor.ops["fill_kv_cache"], fill, written=(2, 3))
    decode, fill = _paged(dtype, HEAD_MAJOR)
    assert vendor.graph_bindings["paged_decode_attention"](*decode) is None  # the permuted view, per call
    assert vendor.graph_bindings["fill_kv_cache"](*fill) is None
    decode, _ = _paged(dtype, TOKEN_MAJOR)
    strided_table = torch.zeros(decode[3].shape[0], 6, dtype=torch.int32)[:, ::2]
    assert vendor.graph_bindings["paged_decode_attention"](*decode[:3], strided_table, *decode[4:]) is None


def test_bound_weight_quant_matmul_gives_the_op_functions_bits():
    from dlinfer.vendor.cpu import weight_quant

    vendor = _cpu()
    g = _g(5)
    k, n, group = 256, 128, 64
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
    offset = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // group, n // 8), dtype=torch.int32, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        scale = (torch.rand(k // group, n, generator=g) / 50).to(dtype)
        layouts = [weight_quant.column_tiled(qweight)]
        if weight_quant.VNNI:
            layouts.append(weight_quant.k_interleaved(qweight, scale, offset, group))
        for packed in layouts:
            for rows in (1, 3, 8):
                x = torch.randn(rows, k, generator=g).to(dtype)
                args = (x, packed, scale, offset, None, group)
                bound = vendor.graph_bindings["weight_quant_matmul"](*args)
                if packed.dtype == torch.int32 and rows > weight_quant.GEMV_MAX_ROWS:  # portable builds: BLAS
                    assert bound is None, rows
                    continue
                assert bound is not None, (packed.dtype, rows)
                _same(bound, vendor.ops["weight_quant_matmul"], args)
        x = torch.randn(weight_quant.GEMV_MAX_ROWS + 1, k, generator=g).to(dtype)
        assert vendor.graph_bindings["weight_quant_matmul"](x, layouts[0], scale, offset, None, group) is None


def test_calls_the_op_function_must_decide_are_not_bound():
    vendor = _cpu()
    bind = vendor.graph_bindings
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    assert bind["linear"](torch.randn(9, 64), w, None) is None  # beyond the few-row kernels: BLAS
    assert bind["linear"](x, w.half(), None) is None  # mixed dtypes: the torch vendor's path
    assert bind["linear"](x, torch.randn(64, 32).t(), None) is None  # a strided weight
    assert bind["rms_norm"](x, torch.ones(64, dtype=torch.float64), 1e-6) is None  # converted per call
    assert bind["rms_norm"](x, torch.ones(128)[::2], 1e-6) is None  # made dense per call
    q, k = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    assert bind["apply_rotary_pos_emb"](q, k, torch.randn(2, 32), torch.randn(2, 32).bfloat16()) is None


def test_a_bound_kernel_refuses_arguments_other_than_the_traced_ones():
    """What a binding skips, the kernel checks: a call that differs from the traced one raises."""
    vendor = _cpu()
    bind = vendor.graph_bindings
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    linear = bind["linear"](x, w, None)
    with pytest.raises(RuntimeError, match="linear"):
        linear(x, w.bfloat16(), None)
    with pytest.raises(RuntimeError):
        linear(x, torch.randn(64, 32).t(), None)
    linear16 = bind["linear"](x.bfloat16(), w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="at most"):
        linear16(torch.randn(9, 64).bfloat16(), w.bfloat16(), None)
    norm = bind["rms_norm"](x, torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm"):
        norm(x, torch.ones(64, dtype=torch.float64), 1e-6)
    decode, _ = _paged(torch.float32, TOKEN_MAJOR)
    attention = bind["paged_decode_attention"](*decode)
    strided_table = torch.zeros(decode[3].shape[0], 6, dtype=torch.int32)[:, ::2]
    with pytest.raises(RuntimeError, match="block_table"):
        attention(*decode[:3], strided_table, *decode[4:])
