"""DLINFER_LM_HEAD=int4 (dlinfer/framework/lmdeploy_ext/backend/lm_head.py): the LM head rounded to
4 bits per group of 32 input channels after loading, run by `weight_quant_matmul`. The head's
logits against this test's own float64 rules; through `lmdeploy.pipeline` on device_type="cpu" the
engine gives the greedy tokens of HF transformers whose head this test fake-quantises itself
(quantized_models.fake_quant_lm_head_int4), eager and graph mode; `auto` never picks it."""

from __future__ import annotations

import logging

import pytest
import torch
from support.engine_helpers import HFReference, assert_matches_hf, cpu_pipeline, greedy_generate
from support.quantized_models import FakeQuantReference, Int4HeadReference, quantized_model
from support.tiny_models import VOCAB_SIZE, tiny_model

import dlinfer.ops
from dlinfer.conformance.tolerances import tolerance
from dlinfer.framework.lmdeploy_ext.backend import lm_head

NEW_TOKENS = 12
GROUP = 32  # the contract: input channels per group
PROMPTS = (
    "A small blue window in the dark forest",
    "The model reads a prompt token by token and the engine keeps every key and value in the cache",
)
_references: dict = {}


def _int4_logits_fp64(x, weight, scale_dtype=torch.float32):
    """The int4 head's logits by this test's rules: per group of GROUP input channels
    s = (max - min) / 15 in float32 rounded to scale_dtype, z = clamp(round(-min / s), 0, 15),
    q = clamp(round(w / s) + z, 0, 15) (float32, half to even); logits = x @ ((q - z) * s)^T in
    float64."""
    w = weight.float()
    v, h = w.shape
    groups = w.reshape(v, h // GROUP, GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    s = ((hi - lo).clamp(min=1e-5) / 15).to(scale_dtype).float()
    z = torch.clamp(torch.round(-lo / s), 0, 15)
    q = torch.clamp(torch.round(groups / s) + z, 0, 15)
    deq = ((q - z).double() * s.double()).reshape(v, h)
    return x.double() @ deq.T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_is_the_grouped_4bit_product(dtype):
    assert lm_head.INT4_GROUP == GROUP
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(72, 192, generator=g) * 0.1).to(dtype)
    x = torch.randn(3, 192, generator=g).to(dtype)
    head = lm_head.Int4LMHead(weight, None, tied=False)
    assert head.weight.numel() == 0 and head.out_dtype == dtype and "int4" in repr(head)
    expected = _int4_logits_fp64(x, weight, scale_dtype=dtype)
    out = head(x)
    assert out.dtype == dtype and out.shape == (3, 72)
    rtol, atol = tolerance("weight_quant_matmul", dtype)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol * expected.abs().max().item())


def test_the_4bit_rule_is_not_the_float_head():
    """The rounding is visible: the head's logits are not the float product's (the check above
    discriminates), and a group's 16 levels hold its min and max exactly."""
    g = torch.Generator().manual_seed(6)
    weight, x = torch.randn(64, 128, generator=g), torch.randn(2, 128, generator=g)
    head = lm_head.Int4LMHead(weight, None, tied=False)
    exact = x.double() @ weight.double().T
    assert (head(x).double() - exact).abs().max() > 1e-2
    qweight, scales, qzeros = lm_head.quantize_groups(weight, GROUP, torch.float32)
    assert qweight.shape == (128, 8) and scales.shape == (4, 64) and qzeros.shape == (4, 8)


def test_a_tied_head_keeps_the_table_and_requantises_after_an_update():
    g = torch.Generator().manual_seed(7)
    table = torch.nn.Parameter(torch.randn(64, 128, generator=g), requires_grad=False)
    head = lm_head.Int4LMHead(table, None, tied=True)
    assert head.weight is table
    x = torch.randn(2, 128, generator=g)
    before = head(x)
    table.data.mul_(-2.0)
    head.update_weights()
    torch.testing.assert_close(head(x).double(), _int4_logits_fp64(x, table.data), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(before, head(x))


def test_a_head_its_packing_cannot_hold_stays_float(caplog):
    """A vocabulary not a multiple of 8 or input features not a multiple of 32: a ValueError from the
    class naming the shape; `install` leaves such a head float with a warning naming why."""
    with pytest.raises(ValueError, match=r"Int4LMHead: the head \[60, 128\] needs a vocabulary that is a multiple "
                                         r"of 8 and input features a multiple of 32"):
        lm_head.Int4LMHead(torch.randn(60, 128), None, tied=False)
    from lmdeploy.pytorch.nn.linear.default import BaseLinear

    model = torch.nn.Module()
    model.lm_head = BaseLinear(80, 16, bias=False, dtype=torch.float32, device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="dlinfer.lmdeploy.lm_head"):
        assert lm_head.install(model, kind="int4") == 0
    assert isinstance(model.lm_head, BaseLinear)
    assert "DLINFER_LM_HEAD=int4: lm_head stays float: the head [16, 80] needs" in caplog.text


def test_install_never_smooths_the_int4_head():
    """The calibration ranges smooth an int8 head; an int4 head ignores them (it rounds no input)."""
    from lmdeploy.pytorch.nn.linear.default import BaseLinear

    g = torch.Generator().manual_seed(8)
    for kind, cls in (("int8", lm_head.Int8LMHead), ("int4", lm_head.Int4LMHead)):
        model = torch.nn.Module()
        model.lm_head = BaseLinear(64, 16, bias=False, dtype=torch.float32, device=torch.device("cpu"))
        assert lm_head.install(model, torch.rand(64, generator=g) + 0.5, kind=kind) == 1
        assert isinstance(model.lm_head, cls) and (model.lm_head.smooth is not None) is (kind == "int8")


def test_the_option_and_auto():
    assert lm_head.read_option({lm_head.ENV: " INT4 "}) == "int4"
    assert lm_head.choose("int4", None) == "int4" and lm_head.choose("int4", "awq") == "int4"
    assert lm_head.choose("auto", "awq") == "int8" and lm_head.choose("auto", None) == "float"


# ---- through the engine ---------------------------------------------------------------------------

@pytest.fixture
def head_calls(monkeypatch):
    """data_ptr of the qweight of every weight_quant_matmul call."""
    calls = []
    op = dlinfer.ops.weight_quant_matmul
    monkeypatch.setattr(dlinfer.ops, "weight_quant_matmul",
                        lambda *a, **k: calls.append(a[1].data_ptr()) or op(*a, **k))
    return calls


def _run(folder, monkeypatch, **engine):
    monkeypatch.setenv(lm_head.ENV, "int4")
    with cpu_pipeline(folder, enable_prefix_caching=False, **engine) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        model = runner.get_model() if hasattr(runner, "get_model") else runner
        head, embedding = model.lm_head, model.get_input_embeddings().weight
    return results, head, embedding


def _reference(kind, folder):
    key = (kind, str(folder))
    if key not in _references:
        _references[key] = {"float": HFReference, "int4": Int4HeadReference,
                            "quant-int4": lambda f: FakeQuantReference(f, int4_head=True)}[kind](folder)
    return _references[key]


@pytest.mark.slow
@pytest.mark.parametrize("name,eager", [("llama", True), ("llama_tied", True), ("qwen2", False)])
def test_int4_head_matches_fake_quant_hf(name, eager, monkeypatch, head_calls):
    folder = tiny_model(name)
    results, head, embedding = _run(folder, monkeypatch, eager_mode=eager, max_batch_size=2)
    assert isinstance(head, lm_head.Int4LMHead), type(head)
    assert head.out_features == VOCAB_SIZE and head.tied is (name == "llama_tied")
    assert (head.weight is embedding) is head.tied and embedding.dtype == torch.float32
    assert head_calls.count(head.qweight.data_ptr()) >= NEW_TOKENS, "the int4 head did not run every step"
    assert_matches_hf(results, _reference("int4", folder), NEW_TOKENS)


@pytest.mark.slow
def test_the_int4_reference_is_not_the_float_models():
    """Matching the int4-head reference discriminates: its greedy tokens differ from the float
    model's for at least one prompt."""
    from transformers import AutoTokenizer

    folder = tiny_model("llama")
    int4_ref, float_ref = _reference("int4", folder), _reference("float", folder)
    tok, bos = AutoTokenizer.from_pretrained(folder), int4_ref.model.config.bos_token_id
    prompts = [[bos] + tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    assert any(int4_ref.greedy(p, NEW_TOKENS, [])[0] != float_ref.greedy(p, NEW_TOKENS, [])[0] for p in prompts)


@pytest.mark.slow
def test_int4_head_on_an_awq_checkpoint(monkeypatch, head_calls):
    """The use it is for: a W4A16 checkpoint (its folder holds the head's input ranges, which the
    int4 head ignores) with DLINFER_LM_HEAD=int4 gives the tokens of HF running the dequantised
    weights and the fake-quantised int4 head."""
    from test_quantized import PROMPTS as QUANTIZED_PROMPTS

    folder = quantized_model("llama", "awq", group_size=64)
    assert (folder / "lm_head_input_absmax.safetensors").is_file()
    monkeypatch.setenv(lm_head.ENV, "int4")
    with cpu_pipeline(folder, enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, QUANTIZED_PROMPTS, NEW_TOKENS)
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        head = (runner.get_model() if hasattr(runner, "get_model") else runner).lm_head
    assert isinstance(head, lm_head.Int4LMHead) and head.smooth is None
    assert head_calls.count(head.qweight.data_ptr()) >= NEW_TOKENS
    assert_matches_hf(results, _reference("quant-int4", folder), NEW_TOKENS)
