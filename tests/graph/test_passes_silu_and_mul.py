"""silu_and_mul pass: the sliced / chunked gate-up form fires (Phi-3's MLP), HF Llama's MLP with
separate gate and up linears is left alone."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from .helpers import assert_same, capture, count, dl_counts, rewrite, run_graph

I = 48


def _x(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check(fn, *args, tol=0.0):
    gm, inputs = capture(fn, *args)
    before = run_graph(gm, inputs)
    counts = rewrite(gm, "silu_and_mul")
    after = run_graph(gm, inputs)
    assert_same(after, before, atol=tol, rtol=tol)
    return gm, counts


@pytest.mark.parametrize("shape", [(5, 2 * I), (2, 3, 2 * I)])
def test_slice_form(shape):
    gm, counts = _check(lambda x: F.silu(x[..., :I]) * x[..., I:], _x(*shape))
    assert counts == {"silu_and_mul": 1} and dl_counts(gm) == {"silu_and_mul": 1}
    assert count(gm, "silu") == 0 and count(gm, "mul") == 0 and count(gm, "getitem") == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_explicit_slices_and_sigmoid_spelling(dtype):
    def f(x):
        g = x[:, :, :I]
        return x[:, :, I:] * (g * torch.sigmoid(g))

    # silu written out rounds sigmoid(g) to half precision first; F.silu (the op) does not
    gm, counts = _check(f, _x(2, 3, 2 * I, dtype=dtype), tol=1e-2)
    assert counts == {"silu_and_mul": 1} and dl_counts(gm) == {"silu_and_mul": 1}


def test_hf_phi3_mlp_fires():
    mlp = Phi3MLP(Phi3Config(hidden_size=32, intermediate_size=I, hidden_act="silu")).eval()
    gm, counts = _check(mlp, _x(2, 4, 32))
    assert counts == {"silu_and_mul": 1} and dl_counts(gm) == {"silu_and_mul": 1}
    assert count(gm, "chunk") == 0


def test_hf_llama_mlp_left_alone():
    """act_fn(gate_proj(x)) * up_proj(x): no [.., 2I] tensor exists, nothing to hand the op."""
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=I, hidden_act="silu")).eval()
    gm, counts = _check(mlp, _x(2, 4, 32))
    assert counts == {"silu_and_mul": 0} and dl_counts(gm) == {}
    assert count(gm, "silu") == 1


@pytest.mark.parametrize("case", ["uneven", "swapped_halves", "gelu", "gate_used_elsewhere", "other_tensor"])
def test_not_rewritten(case):
    x = _x(4, 2 * I)
    if case == "uneven":
        f = lambda x: F.silu(x[..., : I - 1]) * x[..., I + 1:]  # noqa: E731
    elif case == "swapped_halves":  # silu of the second half: the op gates with the first
        f = lambda x: F.silu(x[..., I:]) * x[..., :I]  # noqa: E731
    elif case == "gelu":
        f = lambda x: F.gelu(x[..., :I]) * x[..., I:]  # noqa: E731
    elif case == "gate_used_elsewhere":
        def f(x):
            s = F.silu(x[..., :I])
            return s * x[..., I:], s
    else:
        f = lambda x: F.silu(x[..., :I]) * (x + 1)[..., I:]  # noqa: E731
    gm, counts = _check(f, x)
    assert counts == {"silu_and_mul": 0} and dl_counts(gm) == {}, gm.code
