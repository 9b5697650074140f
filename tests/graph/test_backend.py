"""The dlinfer torch.compile backend: registration, full-graph capture of dlinfer ops, parity with
eager (outputs and KV caches), passes firing on an HF layer, switches, vendor graph compilers."""

import importlib.metadata
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import dlinfer.graph.backend as backend_mod
from dlinfer.graph import dlinfer_backend, match
from dlinfer.vendor import TOKEN_MAJOR, Vendor, registry, selection

from .helpers import DlinferLlamaStack, assert_same, capture, clone_caches, decode_inputs, dl_counts, swap_caches


def test_registered_as_dynamo_backend():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "dlinfer" and ep.value == "dlinfer.graph.backend:dlinfer_backend" for ep in eps)
    from torch._dynamo.backends.registry import lookup_backend

    assert "dlinfer" in torch._dynamo.list_backends()
    assert lookup_backend("dlinfer") is dlinfer_backend


_FIRST_CALL_TRACED = """
import torch
import dlinfer.ops as ops

def norm(x, w):
    return ops.rms_norm(x, w, 1e-6)

x, w = torch.randn(3, 64), torch.rand(64) + 0.5
got = torch.compile(norm, backend="dlinfer", fullgraph=True)(x, w)  # the process's first op call
want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
torch.testing.assert_close(got, want)
print("ok")
"""


def test_a_processs_first_op_call_compiles_fullgraph():
    """While Dynamo traces a process's first op call, the vendor is loaded (an import, which Dynamo
    cannot trace) inside a function marked constant (ops/_dispatch.py): fullgraph still captures
    it. A fresh process, so no earlier call has loaded and cached the vendor."""
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL_TRACED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.fixture(scope="module")
def stack():
    return DlinferLlamaStack(layers=2).eval()


def test_llama_layers_fullgraph_one_node_per_op(stack):
    """Dynamo captures the whole stack (fullgraph: no graph break, value checks on) and every
    dlinfer op call is exactly one node, nothing of the vendor's implementation leaking in."""
    x, cos, sin, caches, meta = decode_inputs([5, 9, 2])
    gm, _ = capture(stack, x, cos, sin, caches, meta)
    assert dl_counts(gm) == {"rms_norm": 1, "add_rms_norm": 3, "linear": 8, "apply_rotary_pos_emb": 2,
                             "fill_kv_cache": 2, "paged_decode_attention": 2, "silu_and_mul": 2}
    targets = {str(n.target) for n in gm.graph.nodes
               if n.op in ("call_function", "call_method") and not match.is_dlinfer_op(n)}
    for leaked in ("scaled_dot_product_attention", "rsqrt", "silu", "index_select", "index_put"):
        assert not any(leaked in t for t in targets), (leaked, targets)


@pytest.fixture(scope="module", params=["inductor", "direct"])
def compiled_stack(request, stack):
    """The stack compiled once per graph compiler (the backend's default, and LMDeploy's)."""
    torch._dynamo.reset()
    return torch.compile(stack, backend="dlinfer", fullgraph=True, options={"compiler": request.param})


@pytest.mark.parametrize("kv_lens", [[5, 9, 2], [6, 10, 3], [1, 16, 7]])
def test_backend_matches_eager_outputs_and_caches(stack, compiled_stack, kv_lens):
    x, cos, sin, caches, meta = decode_inputs(kv_lens)
    eager_caches, graph_caches = clone_caches(caches), clone_caches(caches)
    with torch.inference_mode():
        expected = stack(x, cos, sin, eager_caches, meta)
        got = compiled_stack(x, cos, sin, graph_caches, meta)
    assert_same(got, expected, atol=1e-6, rtol=1e-6)
    for (ke, ve), (kg, vg) in zip(eager_caches, graph_caches):  # written in place, identically
        assert torch.equal(kg, ke) and torch.equal(vg, ve)
    assert not all(torch.equal(a, b) for a, b in zip(caches[0], graph_caches[0]))


def test_inductor_keeps_dlinfer_ops_opaque(stack):
    from torch._inductor.utils import run_and_get_code

    x, cos, sin, caches, meta = decode_inputs([4, 4])
    torch._dynamo.reset()
    with torch.inference_mode():
        _, codes = run_and_get_code(torch.compile(stack, backend="dlinfer"), x, cos, sin, caches, meta)
    code = "\n".join(codes)
    for op in ("rms_norm", "add_rms_norm", "linear", "apply_rotary_pos_emb", "fill_kv_cache",
               "paged_decode_attention", "silu_and_mul"):
        assert f"torch.ops.dlinfer.{op}.default" in code, op
    assert "scaled_dot_product" not in code
    assert "clone" not in code.split("def call(")[1]  # caches mutated in place, never copied


def test_direct_compiler_binds_vendor_kernels(stack, monkeypatch):
    """compiler="direct" (call-site bindings off: tests/graph/test_graph_bindings.py has them): no
    torch.ops.dlinfer call left, each node calls its vendor kernel."""
    from dlinfer.graph.backend import direct_compiler
    from dlinfer.vendor import resolve

    monkeypatch.setenv("DLINFER_GRAPH_BIND", "0")
    x, cos, sin, caches, meta = decode_inputs([3, 5])
    captured_caches = clone_caches(caches)
    gm, inputs = capture(stack, x, cos, sin, captured_caches, meta)
    n_ops = dl_counts(gm)
    forward = direct_compiler(gm, inputs)
    assert dl_counts(gm) == {}
    kernels = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert kernels.count(resolve("paged_decode_attention", "cpu")[0]) == n_ops["paged_decode_attention"]
    assert kernels.count(resolve("linear", "cpu")[0]) == n_ops["linear"]
    eager_caches, graph_caches = clone_caches(caches), clone_caches(caches)
    with torch.inference_mode():
        expected = stack(x, cos, sin, eager_caches, meta)
        got = forward(*[swap_caches(t, captured_caches, graph_caches) for t in inputs])
    assert_same(got, expected, atol=1e-6, rtol=1e-6)
    assert all(torch.equal(a, b) for pg, pe in zip(graph_caches, eager_caches) for a, b in zip(pg, pe))


def _hf_layer():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=128, rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer, rope = LlamaDecoderLayer(cfg, 0).eval(), LlamaRotaryEmbedding(cfg)

    def forward(x, pos):
        return layer(x, position_embeddings=rope(x, pos), attention_mask=None, position_ids=pos)

    return forward


def test_hf_decoder_layer_through_backend():
    """The passes fire inside torch.compile(backend="dlinfer") on a real HF Llama layer, and the
    Inductor-compiled result matches HF eager."""
    forward = _hf_layer()
    x, pos = torch.randn(2, 5, 64), torch.arange(5).expand(2, 5)
    torch._dynamo.reset()
    before = backend_mod.stats.copy()
    with torch.inference_mode():
        expected = forward(x, pos)
        got = torch.compile(forward, backend="dlinfer", fullgraph=True)(x, pos)
    fired = backend_mod.stats - before
    assert fired["rms_norm"] == 2 and fired["add_rms_norm"] == 1 and fired["rotary"] == 2
    assert fired["compiler:inductor"] == 1
    assert_same(got, expected, atol=1e-5, rtol=1e-5)


def _graph_of(options=None):
    """dlinfer op counts of the graph the backend hands its compiler (compiler 'eager': fast)."""
    seen = {}

    def compiler(gm, example_inputs):
        seen.update(dl_counts(gm))
        return gm.forward

    forward = _hf_layer()
    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(forward, backend="dlinfer", options={"compiler": compiler, **(options or {})})(
            torch.randn(1, 3, 64), torch.arange(3)[None])
    return seen


def test_switches(monkeypatch):
    assert _graph_of() == {"rms_norm": 1, "add_rms_norm": 1, "apply_rotary_pos_emb": 1}
    monkeypatch.setenv("DLINFER_GRAPH_PASSES", "none")
    assert _graph_of() == {}
    assert _graph_of({"passes": "rms_norm"}) == {"rms_norm": 2}  # the option wins over the env var
    monkeypatch.setenv("DLINFER_GRAPH_PASSES", "-rotary,-add_rms_norm")
    assert _graph_of() == {"rms_norm": 2}
    with pytest.raises(Exception, match="unknown pass"):
        _graph_of({"passes": "fuse_everything"})
    with pytest.raises(Exception, match="unknown option"):
        _graph_of({"pases": "all"})


def test_vendor_graph_compiler_is_used(monkeypatch):
    seen = []

    def vendor_compiler(gm, example_inputs):
        seen.append(dl_counts(gm))
        return gm.forward

    vendor = Vendor(name="graphtest", device_types=("*",), kv_layouts=(TOKEN_MAJOR,),
                    ops=dict(registry.load("torch").ops), graph_compiler=vendor_compiler)
    monkeypatch.setitem(registry._loaded, "graphtest", vendor)
    before = backend_mod.stats.copy()
    forward = _hf_layer()
    x, pos = torch.randn(1, 3, 64), torch.arange(3)[None]
    torch._dynamo.reset()
    with selection.using("graphtest"), torch.inference_mode():
        expected = forward(x, pos)
        got = torch.compile(forward, backend="dlinfer")(x, pos)
    assert seen == [{"rms_norm": 1, "add_rms_norm": 1, "apply_rotary_pos_emb": 1}]
    assert (backend_mod.stats - before)["compiler:graphtest"] == 1
    assert_same(got, expected, atol=1e-6, rtol=1e-6)


def test_grad_mode_graph_runs_without_autograd():
    """Parameters that require grad, no no_grad(): the dlinfer graph still compiles and runs."""
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.ones(64))
    forward = lambda x: norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # noqa: E731
    torch._dynamo.reset()
    x = torch.randn(3, 64)
    got = torch.compile(forward, backend="dlinfer", options={"compiler": "eager"})(x)
    assert_same(got, forward(x).detach(), atol=1e-6, rtol=1e-6)
