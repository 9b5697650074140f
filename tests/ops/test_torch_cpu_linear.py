"""The torch vendor's CPU float32 linear: which kernel runs, and both kernels against fp64."""

import os
import subprocess
import sys

import pytest
import torch

from dlinfer.conformance import reference as ref
from dlinfer.conformance.compare import assert_close
from dlinfer.conformance.inputs import randn
from dlinfer.vendor.torch import linear as torch_linear

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _read_switch(monkeypatch, value):
    monkeypatch.setenv("DLINFER_CPU_LINEAR", value)
    torch_linear._onednn_enabled.cache_clear()
    try:
        return torch_linear._onednn_enabled()
    finally:
        torch_linear._onednn_enabled.cache_clear()


def test_env_switch(monkeypatch):
    assert _read_switch(monkeypatch, "aten") is False
    assert _read_switch(monkeypatch, "onednn") is ONEDNN
    with pytest.warns(UserWarning, match="DLINFER_CPU_LINEAR"):  # a bad value warns, keeps the default
        assert _read_switch(monkeypatch, "mkl") is ONEDNN


def test_bad_env_value_does_not_stop_the_vendor_loading():
    """The switch is read at the first float32 call, not at import: the fallback vendor loads."""
    env = dict(os.environ, DLINFER_CPU_LINEAR="mkl")
    code = "import dlinfer.vendor as v; v.load('torch'); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr


def _force(monkeypatch, onednn: bool):
    monkeypatch.setattr(torch_linear, "_onednn_enabled", lambda: onednn)


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
def test_float32_cpu_takes_onednn(monkeypatch):
    _force(monkeypatch, True)
    w = torch.randn(5, 7)
    assert torch_linear.uses_onednn(torch.randn(3, 7), w)
    assert not torch_linear.uses_onednn(torch.randn(3, 7, dtype=torch.bfloat16), w.bfloat16())
    assert not torch_linear.uses_onednn(torch.randn(3, 7), torch.randn(7, 5).t())  # strided weight
    assert not torch_linear.uses_onednn(torch.randn(3, 7, requires_grad=True), w)  # autograd would record it
    with torch.inference_mode():
        assert torch_linear.uses_onednn(torch.randn(3, 7, requires_grad=True), w)
    _force(monkeypatch, False)
    assert not torch_linear.uses_onednn(torch.randn(3, 7), w)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "aten"])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_both_kernels_match_fp64(monkeypatch, onednn, rows, bias):
    if onednn and not ONEDNN:
        pytest.skip("torch built without oneDNN")
    _force(monkeypatch, onednn)
    g = torch.Generator().manual_seed(rows * 2 + bias)
    x = randn((rows, 200), torch.float32, g, device="cpu")[:, 3:180]  # rows with a stride wider than K
    w = randn((131, 177), torch.float32, g, scale=177**-0.5, device="cpu")
    b = randn((131,), torch.float32, g, scale=0.5, device="cpu") if bias else None
    assert torch_linear.uses_onednn(x, w) is onednn
    with torch.inference_mode():
        out = torch_linear.linear(x, w, b)
    assert out.layout == torch.strided and out.dtype == torch.float32
    assert_close(out, ref.linear(x, w, b), "linear")
