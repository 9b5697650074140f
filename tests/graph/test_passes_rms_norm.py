"""rms_norm / add_rms_norm passes: before/after graphs on HF-style modules, and the cases that
must stay untouched."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .helpers import assert_same, capture, count, dl_count, dl_counts, rewrite, run_graph

H = 64


def _hf_norm(dtype=torch.float32, weight_dtype=None, eps=1e-6):
    norm = LlamaRMSNorm(H, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(3)))
    return norm.to(weight_dtype or dtype)


def _x(*shape, dtype=torch.float32, seed=0):
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _check(fn, *args, names=("rms_norm", "add_rms_norm"), atol=0.0, rtol=0.0):
    gm, inputs = capture(fn, *args)
    before = run_graph(gm, inputs)
    counts = rewrite(gm, *names)
    after = run_graph(gm, inputs)
    assert_same(after, before, atol=atol, rtol=rtol)
    return gm, counts


@pytest.mark.parametrize("shape", [(5, H), (2, 3, H), (1, 1, 4, H)])
def test_hf_llama_rms_norm(shape):
    norm = _hf_norm()
    gm, counts = _check(norm, _x(*shape))
    assert counts["rms_norm"] == 1
    assert dl_counts(gm) == {"rms_norm": 1}
    for name in ("pow", "mean", "rsqrt", "mul"):  # the unfused pattern is gone
        assert count(gm, name) == 0, (name, gm.code)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hf_llama_rms_norm_half(dtype):
    norm = _hf_norm(dtype)
    gm, counts = _check(norm, _x(3, H, dtype=dtype))
    assert counts["rms_norm"] == 1 and dl_count(gm, "rms_norm") == 1


def test_spellings():
    w = 1 + 0.1 * torch.randn(H)

    def f(x, w):
        a = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * w  # fp32: no casts
        b = w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))  # sqrt / div, x * x
        xf = x.float()
        c = (xf * torch.rsqrt(torch.mean(torch.square(xf), [-1], keepdim=True) + 1e-6)).to(x.dtype).mul(w)
        return a, b, c

    gm, counts = _check(f, _x(4, H), w, atol=1e-6, rtol=1e-6)
    assert counts["rms_norm"] == 3 and dl_count(gm, "rms_norm") == 3 and count(gm, "mean") == 0


def test_residual_add_fused():
    norm = _hf_norm()

    def f(h, r):
        s = h + r
        return norm(s), s * 2

    gm, counts = _check(f, _x(2, 5, H), _x(2, 5, H, seed=1))
    assert counts == {"rms_norm": 1, "add_rms_norm": 1}
    assert dl_counts(gm) == {"add_rms_norm": 1}
    assert count(gm, "add") == 0


def test_residual_add_into_dlinfer_rms_norm():
    """A model written with dlinfer.ops.rms_norm after an add gets add_rms_norm too."""
    import dlinfer.ops as ops

    w = 1 + 0.1 * torch.randn(H)

    def f(h, r, w):
        s = h + r
        return ops.rms_norm(s, w, 1e-6), s

    gm, counts = _check(f, _x(3, 2, H), _x(3, 2, H, seed=1), w, names=("add_rms_norm",))
    assert counts == {"add_rms_norm": 1} and dl_counts(gm) == {"add_rms_norm": 1}


def test_switch_off_leaves_graph_alone():
    gm, counts = _check(_hf_norm(), _x(3, H), names=())
    assert counts == {} and dl_count(gm) == 0 and count(gm, "rsqrt") == 1


@pytest.mark.parametrize("case", ["fp32_weight_bf16_input", "mean_dim0", "no_keepdim", "variance_escapes",
                                  "broadcast_residual", "half_without_upcast", "input_written_in_place"])
def test_not_rewritten(case):
    w = 1 + 0.1 * torch.randn(H)
    x = _x(4, H)
    if case == "fp32_weight_bf16_input":  # HF returns float32 here; the fused op would return bf16
        fn, args = _hf_norm(torch.bfloat16, weight_dtype=torch.float32), (x.bfloat16(),)
    elif case == "mean_dim0":
        fn, args = (lambda x, w: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w), (x, w)
    elif case == "no_keepdim":
        fn, args = (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1)[:, None] + 1e-6) * w), (x, w)
    elif case == "variance_escapes":
        def fn(x, w):
            var = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(var + 1e-6) * w, var
        args = (x, w)
    elif case == "broadcast_residual":  # h + r broadcasts: no add_rms_norm, rms_norm alone
        norm = _hf_norm()
        fn, args = (lambda h, r: norm(h + r)), (x, _x(1, H))
    elif case == "half_without_upcast":  # float16 normalisation without the float32 upcast: not the op
        fn, args = (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w), (x.half(), w.half())
    else:  # the fused op would be placed right after its inputs, before the write
        def fn(x, w):
            x.mul_(2)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        args = (x.clone(), w)
    gm, counts = _check(fn, *args)
    if case == "broadcast_residual":
        assert counts == {"rms_norm": 1, "add_rms_norm": 0}
    else:
        assert not any(counts.values()) and dl_count(gm) == 0, gm.code
