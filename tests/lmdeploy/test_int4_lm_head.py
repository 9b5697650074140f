"""DLINFER_LM_HEAD=int4 (dlinfer/framework/lmdeploy_ext/backend/lm_head.py): the LM head rounded to
4 bits per group of 32 input channels after loading, run by `weight_quant_matmul`. The head's
logits against the rule quantized_models.fake_quant_lm_head_int4 writes out (float64); through
`lmdeploy.pipeline` on device_type="cpu" the engine gives the greedy tokens of HF transformers
whose head this test fake-quantises itself, eager and graph mode, tied and untied, on a float and
an AWQ checkpoint; `auto` never picks it."""

from __future__ import annotations

import logging

import pytest
import torch
from support.engine_helpers import HFReference, assert_matches_hf, cpu_pipeline, greedy_generate
from support.quantized_models import FakeQuantReference, Int4HeadReference, fake_quant_lm_head_int4, quantized_model
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
# the scales' dtype for each head dtype (float16 for float32 heads, as AWQ checkpoints store them)
SCALE_DTYPES = {torch.float32: torch.float16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}
_references: dict = {}


def _int4_logits_fp64(x, weight, scale_dtype=torch.float16, input_absmax=None):
    """The int4 head's logits by the rule quantized_models.fake_quant_lm_head_int4 writes out (this
    test's reference, not the code under test): x @ dequantised^T in float64."""
    holder = torch.nn.Module()
    holder.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    holder.lm_head.weight = torch.nn.Parameter(weight.float().clone(), requires_grad=False)
    fake_quant_lm_head_int4(holder, input_absmax, GROUP, scale_dtype)
    return x.double() @ holder.lm_head.weight.double().T


@pytest.mark.parametrize("dtype", list(SCALE_DTYPES))
@pytest.mark.parametrize("clipped", [False, True])
def test_the_head_is_the_grouped_4bit_product(dtype, clipped):
    assert lm_head.INT4_GROUP == GROUP
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(72, 192, generator=g) * 0.1).to(dtype)
    x = torch.randn(3, 192, generator=g).to(dtype)
    ranges = torch.rand(192, generator=g) * 8 if clipped else None
    head = lm_head.Int4LMHead(weight, None, tied=False, input_absmax=ranges)
    assert head.weight.numel() == 0 and head.out_dtype == dtype and "int4" in repr(head)
    assert f"clipped by the input's ranges={clipped}" in repr(head)
    expected = _int4_logits_fp64(x, weight, SCALE_DTYPES[dtype], ranges)
    out = head(x)
    assert out.dtype == dtype and out.shape == (3, 72)
    rtol, atol = tolerance("weight_quant_matmul", dtype)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol * expected.abs().max().item())


def test_the_4bit_rule_is_not_the_float_head():
    """The rounding is visible: the head's logits are not the float product's (the check above
    discriminates); unclipped, the rounding is awq.quant_params' rule; the canonical tensors have
    the W4A16 op's shapes."""
    from dlinfer.quantize.awq import quant_params

    g = torch.Generator().manual_seed(6)
    weight, x = torch.randn(64, 128, generator=g), torch.randn(2, 128, generator=g)
    head = lm_head.Int4LMHead(weight, None, tied=False)
    exact = x.double() @ weight.double().T
    assert (head(x).double() - exact).abs().max() > 1e-2
    qweight, scales, qzeros = lm_head.quantize_groups(weight, GROUP, torch.float16)
    assert qweight.shape == (128, 8) and qzeros.shape == (4, 8)
    assert scales.shape == (4, 64) and scales.dtype == torch.float16
    rounding = lm_head.int4_rounding(weight, GROUP, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(rounding, quant_params(weight, GROUP, torch.float16)))


@pytest.mark.parametrize("dtype", list(SCALE_DTYPES))
def test_the_hook_is_given_scales_in_the_heads_dtype(dtype, monkeypatch):
    """The head hands the vendor's hook its scales in the head's dtype (a float32 head's
    float16-valued ones as float32), as LMDeploy hands a W4 linear's, so the cpu vendor lays the
    head out as it would that model's linears: on an AVX2 build a float32 (or float16) head
    column_tiled (the float kernel) and a bfloat16 one k_interleaved (16-bit activations);
    float16-valued scales are stored as float16 either way."""
    import dlinfer.vendor

    if "cpu" not in dlinfer.vendor.available():
        pytest.skip("the cpu vendor does not load here")
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    monkeypatch.delenv("DLINFER_CPU_W4_ACTIVATIONS", raising=False)
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    given = []
    hook = dlinfer.ops.repack_weight_quant
    monkeypatch.setattr(dlinfer.ops, "repack_weight_quant",
                        lambda q, s, *a, **k: given.append(s.dtype) or hook(q, s, *a, **k))
    weight = (torch.randn(72, 192, generator=torch.Generator().manual_seed(8)) * 0.1).to(dtype)
    with dlinfer.vendor.using("cpu"):
        head = lm_head.Int4LMHead(weight, None, tied=False)
    assert given == [dtype]
    assert head.scales.dtype == SCALE_DTYPES[dtype]
    ki = cpu_w4.layout_for(192, GROUP, dtype) == "k_interleaved"
    assert head.qweight.dtype == (torch.uint8 if ki else torch.int32)
    if cpu_w4.INT16_ACTIVATIONS:
        assert ki == (dtype == torch.bfloat16)


def test_float32_heads_take_float16_scales_unless_they_overflow():
    w = torch.randn(16, 64)
    assert lm_head.int4_scale_dtype(torch.float32, w) == torch.float16
    assert lm_head.int4_scale_dtype(torch.float32, w * 1e6) == torch.float32
    assert lm_head.int4_scale_dtype(torch.bfloat16, w) == torch.bfloat16
    assert lm_head.int4_scale_dtype(torch.float16, w) == torch.float16


def test_chunks_of_rows_give_the_whole_heads_tensors(monkeypatch):
    """quantize_groups rounds and packs _clip_rows(H) rows at a time: the same tensors as in one piece
    (96 rows in chunks of 40, 40 and 16)."""
    g = torch.Generator().manual_seed(10)
    weight, absmax = torch.randn(96, 64, generator=g), torch.rand(64, generator=g)
    whole = lm_head.quantize_groups(weight, GROUP, torch.float16, absmax ** 2)
    monkeypatch.setattr(lm_head, "_CLIP_BYTES", 40 * 4 * 64)
    assert lm_head._clip_rows(64) == 40
    chunked = lm_head.quantize_groups(weight, GROUP, torch.float16, absmax ** 2)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_the_clipping_search_lowers_the_weighted_error_of_every_group():
    """With the input's ranges each group's importance-weighted rounding error is at most the
    unclipped rule's, and below it for some groups (the search is not a no-op)."""
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(256, 128, generator=g)
    weight[:, 5] *= 8.0  # outliers that clipping can trade against the rest of their group
    absmax = torch.rand(128, generator=g) * 4

    def weighted_errors(importance):
        q, z, s = lm_head.int4_rounding(weight, GROUP, torch.float16, importance)
        deq = (q.reshape(256, -1, GROUP) - z[..., None]).double() * s.double()[..., None]
        e = (deq - weight.double().reshape(256, -1, GROUP)) ** 2 * (absmax.double() ** 2).reshape(1, -1, GROUP)
        return e.sum(-1)

    plain, clipped = weighted_errors(None), weighted_errors(absmax ** 2)
    assert bool((clipped <= plain * (1 + 1e-6)).all())
    assert int((clipped < 0.99 * plain).sum()) > 10


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


def test_install_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match=r"install: kind must be one of int8, int4, got 'float'"):
        lm_head.install(torch.nn.Module(), kind="float")


def test_install_smooths_an_int8_head_and_clips_an_int4_one():
    """The calibration ranges smooth an int8 head; an int4 head is never smoothed (it rounds no
    input) but searches its clipping with them."""
    from lmdeploy.pytorch.nn.linear.default import BaseLinear

    g = torch.Generator().manual_seed(8)
    for kind, cls in (("int8", lm_head.Int8LMHead), ("int4", lm_head.Int4LMHead)):
        model = torch.nn.Module()
        model.lm_head = BaseLinear(64, 16, bias=False, dtype=torch.float32, device=torch.device("cpu"))
        assert lm_head.install(model, torch.rand(64, generator=g) + 0.5, kind=kind) == 1
        assert isinstance(model.lm_head, cls) and (model.lm_head.smooth is not None) is (kind == "int8")
        assert (getattr(model.lm_head, "importance", None) is not None) is (kind == "int4")


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


def _run(folder, monkeypatch, prompts=PROMPTS, **engine):
    monkeypatch.setenv(lm_head.ENV, "int4")
    with cpu_pipeline(folder, enable_prefix_caching=False, **engine) as pipe:
        results = greedy_generate(pipe, prompts, NEW_TOKENS)
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
    int4 head's clipping search weighs channels by) with DLINFER_LM_HEAD=int4 gives the tokens of
    HF running the dequantised weights and the fake-quantised int4 head."""
    from test_quantized import PROMPTS as QUANTIZED_PROMPTS

    folder = quantized_model("llama", "awq", group_size=64)
    assert (folder / "lm_head_input_absmax.safetensors").is_file()
    results, head, _ = _run(folder, monkeypatch, prompts=QUANTIZED_PROMPTS)
    assert isinstance(head, lm_head.Int4LMHead) and head.smooth is None and head.importance is not None
    assert head_calls.count(head.qweight.data_ptr()) >= NEW_TOKENS
    assert_matches_hf(results, _reference("quant-int4", folder), NEW_TOKENS)
