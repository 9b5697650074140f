"""The torch vendor's CPU float32 linear: which kernel runs, and both kernels against fp64."""

import pytest
import torch

from dlinfer.vendor.torch import linear as torch_linear

from . import reference as ref
from .cases import randn
from .compare import assert_close

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def test_env_switch(monkeypatch):
    monkeypatch.setenv("DLINFER_CPU_LINEAR", "aten")
    assert torch_linear._onednn_enabled() is False
    monkeypatch.setenv("DLINFER_CPU_LINEAR", "onednn")
    assert torch_linear._onednn_enabled() is ONEDNN
    monkeypatch.setenv("DLINFER_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="DLINFER_CPU_LINEAR"):
        torch_linear._onednn_enabled()


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
def test_float32_cpu_takes_onednn(monkeypatch):
    monkeypatch.setattr(torch_linear, "_ONEDNN", True)
    w = torch.randn(5, 7)
    assert torch_linear.uses_onednn(torch.randn(3, 7), w)
    assert not torch_linear.uses_onednn(torch.randn(3, 7, dtype=torch.bfloat16), w.bfloat16())
    assert not torch_linear.uses_onednn(torch.randn(3, 7), torch.randn(7, 5).t())  # strided weight
    assert not torch_linear.uses_onednn(torch.randn(3, 7, requires_grad=True), w)  # autograd would record it
    with torch.inference_mode():
        assert torch_linear.uses_onednn(torch.randn(3, 7, requires_grad=True), w)
    monkeypatch.setattr(torch_linear, "_ONEDNN", False)
    assert not torch_linear.uses_onednn(torch.randn(3, 7), w)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "aten"])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_both_kernels_match_fp64(monkeypatch, onednn, rows, bias):
    if onednn and not ONEDNN:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(torch_linear, "_ONEDNN", onednn)
    g = torch.Generator().manual_seed(rows * 2 + bias)
    x = randn((rows, 200), torch.float32, g, device="cpu")[:, 3:180]  # rows with a stride wider than K
    w = randn((131, 177), torch.float32, g, scale=177**-0.5, device="cpu")
    b = randn((131,), torch.float32, g, scale=0.5, device="cpu") if bias else None
    assert torch_linear.uses_onednn(x, w) is onednn
    with torch.inference_mode():
        out = torch_linear.linear(x, w, b)
    assert out.layout == torch.strided and out.dtype == torch.float32
    assert_close(out, ref.linear(x, w, b), "linear")
