"""The attention ops' score options (sliding_window, logit_softcapping) at the op layer: what "off"
means, that a vendor without the features refuses them by name and keeps its signature, and that
the options reach the kernel. Their numerics are the conformance suites' (attention window and
soft-cap cases against the fp64 reference, on every vendor)."""

import dataclasses

import pytest
import torch

import dlinfer.ops as ops
from dlinfer.errors import UnsupportedError
from dlinfer.vendor import registry
from dlinfer.vendor.base import FEATURE_ALIBI, FEATURE_KV_QUANT, Capabilities
from dlinfer.vendor.selection import using

T, HQ, HKV, D, BS = 12, 4, 2, 64, 4
OPS = ("prefill_attention", "paged_prefill_attention", "paged_decode_attention")


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, HQ, D, generator=g), torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g)


def _call(op, inputs=None, **options):
    """One call of `op` on a single 12-token sequence (decode: its last token)."""
    q, k, v = inputs or _inputs()
    if op == "prefill_attention":
        lens = torch.tensor([T], dtype=torch.int32)
        return ops.prefill_attention(q, k, v, None, None, lens, lens, T, HQ, HKV, [], **options)
    kc, vc = k.view(T // BS, BS, HKV, D).clone(), v.view(T // BS, BS, HKV, D).clone()
    table = torch.arange(T // BS, dtype=torch.int32).view(1, -1)
    kv = torch.tensor([T], dtype=torch.int32)
    if op == "paged_prefill_attention":
        ends = torch.tensor([T], dtype=torch.int32)
        return ops.paged_prefill_attention(q, k, v, kc, vc, table, BS, ends, kv, T, T, HQ, HKV, [], **options)
    ends = torch.tensor([1], dtype=torch.int32)
    return ops.paged_decode_attention(q[-1:], kc, vc, table, BS, ends, kv, T, HQ, HKV, **options)


@pytest.fixture
def plain_vendor(monkeypatch):
    """The torch vendor's kernels under a vendor that declares neither feature, each kernel
    refusing any keyword (as an out-of-tree vendor written before the options would)."""
    torch_vendor = registry.load("torch")

    def strict(fn):
        def run(*args, **kwargs):
            assert not kwargs, f"a vendor without the features was passed {sorted(kwargs)}"
            return fn(*args)
        return run

    table = {name: (strict(fn) if name in OPS else fn) for name, fn in torch_vendor.ops.items()}
    plain = dataclasses.replace(torch_vendor, name="plain", ops=table,
                                capabilities=Capabilities(features=frozenset({FEATURE_ALIBI, FEATURE_KV_QUANT})))
    monkeypatch.setitem(registry._loaded, "plain", plain)
    with using("plain"):
        yield plain


@pytest.mark.parametrize("op", OPS)
def test_a_vendor_without_the_features_refuses_them_by_name(plain_vendor, op):
    for options, named in (({"sliding_window": 4}, "sliding-window"), ({"logit_softcapping": 5.0}, "soft-capping")):
        with pytest.raises(UnsupportedError) as err:
            _call(op, **options)
        assert "plain" in str(err.value) and op in str(err.value) and named in str(err.value)
    # off (None, LMDeploy's -1, 0 for the cap): the vendor's kernel is called as before the options
    out = _call(op, sliding_window=-1, logit_softcapping=0)
    with using("torch"):
        assert torch.equal(out, _call(op))


@pytest.mark.parametrize("op", OPS)
def test_off_values_and_windows_past_the_sequence_change_nothing(op):
    plain = _call(op)
    for options in ({"sliding_window": None}, {"sliding_window": -1}, {"logit_softcapping": 0.0},
                    {"sliding_window": T}, {"sliding_window": 10 * T}):
        assert torch.equal(_call(op, **options), plain), options


@pytest.mark.parametrize("vendor", ["torch", "cpu"])
@pytest.mark.parametrize("op", OPS)
def test_the_options_reach_the_kernel(vendor, op):
    with using(vendor):
        plain = _call(op)
        assert not torch.allclose(_call(op, sliding_window=3), plain, atol=1e-3)
        assert not torch.allclose(_call(op, logit_softcapping=0.5), plain, atol=1e-3)


def test_graph_mode_passes_the_options_to_the_vendor():
    """Under torch.compile the op is one custom-op node whose trailing schema arguments are the
    options: the compiled call equals the eager one for each combination."""
    for options in ({}, {"sliding_window": 3}, {"logit_softcapping": 0.5}, {"sliding_window": 5,
                                                                             "logit_softcapping": 2.0}):
        for op in OPS:
            torch._dynamo.reset()  # one code object compiled for 12 combinations: past the recompile limit
            inputs = _inputs()
            eager = _call(op, inputs, **options)
            compiled = torch.compile(lambda x: _call(op, x, **options), backend="dlinfer", fullgraph=True)(inputs)
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0, msg=f"{op} {options}")
