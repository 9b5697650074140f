"""DLINFER_LM_HEAD (dlinfer/framework/lmdeploy_ext/backend/lm_head.py): the LM head quantised to int8
after loading. Through `lmdeploy.pipeline` on device_type="cpu" the engine gives the greedy tokens
of HF transformers whose head this test fake-quantises itself (quantized_models.fake_quant_lm_head:
the weight per output row, the input per token), eager and graph mode; `auto` picks int8 for
AWQ / SmoothQuant checkpoints and float for float ones (checked on the engine's model and on the
linear_w8a8 calls that read the head's int8 weight); a bad value is a ValueError."""

from __future__ import annotations

import pytest
import torch
from support.engine_helpers import HFReference, assert_matches_hf, cpu_pipeline, greedy_generate
from support.quantized_models import FakeQuantReference, Int8HeadReference, quantized_model
from support.tiny_models import VOCAB_SIZE, tiny_model
from test_quantized import PROMPTS as QUANTIZED_PROMPTS

import dlinfer.ops
from dlinfer.framework.lmdeploy_ext.backend import lm_head

NEW_TOKENS = 12
PROMPTS = (
    "A small blue window in the dark forest",
    "The model reads a prompt token by token and the engine keeps every key and value in the cache",
    # The tiny Llama's int8-head greedy tokens differ from its float head's here (new token 10).
    "One two three four five six seven eight nine ten hundred thousand the first expert routes the "
    "second token to the last layer while a small blue window in the dark forest opens",
)
_references: dict = {}


def _reference(kind, folder):
    key = (kind, str(folder))
    if key not in _references:
        _references[key] = {"float": HFReference, "int8": Int8HeadReference,
                            "quant-int8": FakeQuantReference,
                            "quant-float": lambda f: FakeQuantReference(f, int8_head=False)}[kind](folder)
    return _references[key]


def _engine_model(pipe) -> torch.nn.Module:
    runner = pipe.async_engine.engine.executor.model_agent.patched_model
    return runner.get_model() if hasattr(runner, "get_model") else runner


@pytest.fixture
def head_calls(monkeypatch):
    """data_ptr of the weight `b` of every linear_w8a8 call."""
    calls = []
    op = dlinfer.ops.linear_w8a8
    monkeypatch.setattr(dlinfer.ops, "linear_w8a8", lambda *a, **k: calls.append(a[1].data_ptr()) or op(*a, **k))
    return calls


def _run(folder, option, monkeypatch, prompts=PROMPTS, **engine):
    if option is None:
        monkeypatch.delenv(lm_head.ENV, raising=False)
    else:
        monkeypatch.setenv(lm_head.ENV, option)
    with cpu_pipeline(folder, enable_prefix_caching=False, **engine) as pipe:
        results = greedy_generate(pipe, prompts, NEW_TOKENS)
        head = _engine_model(pipe).lm_head
        embedding = _engine_model(pipe).get_input_embeddings().weight
    return results, head, embedding


def _assert_int8(head, embedding, calls, tied):
    assert isinstance(head, lm_head.Int8LMHead), type(head)
    assert head.qweight.dtype == torch.int8 and tuple(head.qweight.shape) == (VOCAB_SIZE, 128)
    assert head.tied is tied and (head.weight is embedding) is tied
    assert embedding.dtype == torch.float32  # lookups keep the float table
    if not tied:
        assert head.weight.numel() == 0  # the float weight is gone
    assert calls.count(head.qweight.data_ptr()) >= NEW_TOKENS, "the int8 head's linear_w8a8 did not run every step"


# ---- the option itself -------------------------------------------------------------------------

def test_read_option_accepts_the_choices_case_insensitively():
    assert lm_head.read_option({}) == lm_head.read_option({lm_head.ENV: "  "}) == "auto"  # blank: unset
    assert [lm_head.read_option({lm_head.ENV: v}) for v in ("int8", "FLOAT", " auto ")] == ["int8", "float", "auto"]


@pytest.mark.parametrize("value", ["int2", "in t8", "yes"])
def test_read_option_refuses_other_values_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"DLINFER_LM_HEAD=.*expected one of int8, int4, float, auto"):
        lm_head.read_option({lm_head.ENV: value})


def test_choose():
    assert lm_head.choose("auto", "awq") == lm_head.choose("auto", "smooth_quant") == "int8"
    assert lm_head.choose("auto", None) == lm_head.choose("auto", "fp8") == "float"
    assert lm_head.choose("int8", None) == "int8" and lm_head.choose("float", "awq") == "float"


def test_quantize_rows_is_the_per_row_rule():
    """Scales max|w|/127 (float32), round half to even, a zero row all zero: the test's own rounding."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=g)
    w[2] = 0.0
    w[3, :2] = torch.tensor([127.0, 0.5])    # scale 1: 0.5 rounds to 0 (half to even)
    w[3, 2:] = 0.0
    w[4, :3] = torch.tensor([-254.0, 3.0, 5.0])  # scale 2: 1.5 -> 2, 2.5 -> 2
    w[4, 3:] = 0.0
    q, s = lm_head.quantize_rows(w)
    expected_s = (w.double().abs().amax(-1) / 127).float()
    safe = torch.where(expected_s == 0, torch.ones_like(expected_s), expected_s).double()
    expected_q = torch.clamp(torch.round(w.double() / safe[:, None]), -128, 127).to(torch.int8)
    assert s.dtype == torch.float32 and torch.equal(s, expected_s)
    assert q.dtype == torch.int8 and torch.equal(q, expected_q)
    assert q[3, :2].tolist() == [127, 0] and q[4, :3].tolist() == [-127, 2, 2] and not q[2].any()


def _int8_logits_fp64(x, weight, c=None):
    """The int8 head's logits, by this test's own rules: with factors c [H], the weight's columns
    times c and the input times float32(1 / c) (both float32), then each row of the weight and
    each token rounded to int8 (max|.|/127 in float32, half to even), the integer product exact."""
    x, w = x.float(), weight.float()
    if c is not None:
        x, w = x * (1.0 / c), w * c

    def rows(t):
        s = (t.double().abs().amax(-1) / 127).float().double()
        safe = torch.where(s == 0, torch.ones_like(s), s)
        return torch.clamp(torch.round(t.double() / safe[:, None]), -128, 127), s

    (xq, xs), (wq, ws) = rows(x), rows(w)
    return (xq @ wq.T) * xs[:, None] * ws[None, :]


def test_a_smoothed_head_is_the_smoothed_integer_product():
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(40, 24, generator=g), torch.randn(5, 24, generator=g)
    c = torch.rand(24, generator=g) * 4 + 0.25
    head = lm_head.Int8LMHead(weight, None, tied=False, smooth=c)
    torch.testing.assert_close(head(x).double(), _int8_logits_fp64(x, weight, c), rtol=1e-6, atol=1e-6)
    assert "smoothed=True" in repr(head)
    plain = lm_head.Int8LMHead(weight, None, tied=False)
    torch.testing.assert_close(plain(x).double(), _int8_logits_fp64(x, weight), rtol=1e-6, atol=1e-6)


def test_smoothing_cuts_the_heads_error_where_one_channel_dominates_the_input():
    """The final norm's output has a few large channels; per-token rounding then loses the rest.
    Smoothed by the input's ranges (head_stats.smoothing), the head's error against the float
    logits falls."""
    from dlinfer.quantize import head_stats

    g = torch.Generator().manual_seed(4)
    weight, x = torch.randn(200, 64, generator=g) * 0.05, torch.randn(16, 64, generator=g)
    x[:, 7] *= 60.0
    exact = x.double() @ weight.double().T
    plain = lm_head.Int8LMHead(weight, None, tied=False)(x).double()
    smooth = lm_head.Int8LMHead(weight, None, tied=False, smooth=head_stats.smoothing(head_stats.absmax(x), weight))
    err_plain, err_smooth = (plain - exact).abs().mean(), (smooth(x).double() - exact).abs().mean()
    assert err_smooth < 0.5 * err_plain, (err_smooth, err_plain)


def test_a_smoothing_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match=r"Int8LMHead: smooth must be \[24\].*got \[23\]"):
        lm_head.Int8LMHead(torch.randn(40, 24), None, tied=False, smooth=torch.ones(23))


def test_bad_value_refused_when_the_engine_is_built(monkeypatch):
    monkeypatch.setenv(lm_head.ENV, "int2")
    with pytest.raises(ValueError, match=r"DLINFER_LM_HEAD='int2': expected one of int8, int4, float, auto"):
        with cpu_pipeline(tiny_model("llama")):
            pass


# ---- int8 head on float checkpoints (opt-in) ----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_tied"])
def test_int8_head_matches_fake_quant_hf(name, monkeypatch, head_calls):
    folder = tiny_model(name)
    results, head, embedding = _run(folder, "int8", monkeypatch)
    _assert_int8(head, embedding, head_calls, tied=name == "llama_tied")
    assert_matches_hf(results, _reference("int8", folder), NEW_TOKENS)


@pytest.mark.slow
def test_int8_head_changes_the_reference_tokens():
    """The int8-head reference is not the float model's: matching it discriminates (with the
    Int8LMHead / linear_w8a8 checks above) the int8 head from the float one."""
    folder = tiny_model("llama")
    from transformers import AutoTokenizer

    int8_ref, float_ref = _reference("int8", folder), _reference("float", folder)
    tok, bos = AutoTokenizer.from_pretrained(folder), int8_ref.model.config.bos_token_id
    prompts = [[bos] + tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    assert any(int8_ref.greedy(p, NEW_TOKENS, [])[0] != float_ref.greedy(p, NEW_TOKENS, [])[0] for p in prompts)


@pytest.mark.slow
def test_int8_head_at_tp2(monkeypatch):
    """tp=2: LMDeploy does not split the head; every rank quantises its own copy (tokens only: the
    ranks' models live in their own processes)."""
    folder = tiny_model("llama")
    monkeypatch.setenv(lm_head.ENV, "int8")
    with cpu_pipeline(folder, tp=2, enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(results, _reference("int8", folder), NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_int8_head_graph_mode(name, monkeypatch, head_calls):
    """eager_mode=False: the compiled decode steps' hidden states go through the int8 head."""
    folder = tiny_model(name)
    results, head, embedding = _run(folder, "int8", monkeypatch, eager_mode=False, max_batch_size=2)
    _assert_int8(head, embedding, head_calls, tied=False)
    assert_matches_hf(results, _reference("int8", folder), NEW_TOKENS)


# ---- auto: int8 for quantised checkpoints, float otherwise ------------------------------------

@pytest.mark.slow
def test_auto_keeps_a_float_checkpoint_float(monkeypatch, head_calls):
    folder = tiny_model("llama")
    results, head, _ = _run(folder, None, monkeypatch)
    assert not isinstance(head, lm_head.Int8LMHead) and head.weight.dtype == torch.float32
    assert head_calls == []
    assert_matches_hf(results, _reference("float", folder), NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name,method", [("llama", "awq"), ("qwen2", "smooth_quant")])
def test_auto_quantises_the_head_of_a_quantised_checkpoint(name, method, monkeypatch, head_calls):
    folder = quantized_model(name, method, **({"group_size": 64} if method == "awq" else {}))
    results, head, embedding = _run(folder, "auto", monkeypatch, prompts=QUANTIZED_PROMPTS)
    _assert_int8(head, embedding, head_calls, tied=False)
    # smoothed by the ranges `quantize` wrote: sqrt(max|x_j|) / sqrt(max|w_j|) of the stored head
    from safetensors.torch import load_file

    ranges = load_file(str(folder / "lm_head_input_absmax.safetensors"))["input_absmax"].double()
    wmax = load_file(str(folder / "model.safetensors"))["lm_head.weight"].double().abs().amax(0)
    assert head.smooth is not None
    torch.testing.assert_close(head.smooth.double(), ranges.sqrt() / wmax.sqrt(), rtol=1e-6, atol=0)
    assert_matches_hf(results, _reference("quant-int8", folder), NEW_TOKENS)


@pytest.mark.slow
def test_float_option_keeps_a_quantised_checkpoints_float_head(monkeypatch, head_calls):
    folder = quantized_model("llama", "smooth_quant")
    results, head, _ = _run(folder, "float", monkeypatch, prompts=QUANTIZED_PROMPTS)
    assert not isinstance(head, lm_head.Int8LMHead)
    assert_matches_hf(results, _reference("quant-float", folder), NEW_TOKENS)
