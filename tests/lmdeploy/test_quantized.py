"""Checkpoints written by `python -m dlinfer quantize` through `lmdeploy.pipeline` on
device_type="cpu": the same greedy tokens as HF transformers running a fake-quant reference built
from the written files by the test's own code (quantized_models.py), eager and graph mode. The
engine runs its default DLINFER_LM_HEAD=auto, an int8 LM head for these checkpoints, so the
references fake-quantise the head too (the float head: test_int8_lm_head.py)."""

from __future__ import annotations

import pytest
import torch
from support.engine_helpers import assert_matches_hf, cpu_pipeline, first_difference, greedy_generate
from support.quantized_models import FakeQuantReference, quantized_model

import dlinfer.ops
from dlinfer.vendor import w4_layouts

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
# Prompts whose reference paths have no near tie for every case below, with the float and the int8
# LM head. SmoothQuant: LMDeploy's and the reference's logits differ by up to ~0.1 already at
# prefill (float head too; AWQ/RTN: ~1e-5), so these keep every SmoothQuant reference's top-2
# margin above 0.11 (AWQ/RTN above 2e-3); the previous prompts' 0.007-0.017 held by luck.
PROMPTS = (
    "Is five as dark block at",
    "Model second router last were for quick blue red the eight router ocean forest layer memory",
    "Router hundred ocean at one these device expert attention that ocean thousand dark for batch blue river "
    "vendor head in were forest thousand be been dark two in",
)
_CASES = [(name, method) for method in ("smooth_quant", "awq", "rtn") for name in ("llama", "qwen2")]
_CASES.append(("mixtral", "smooth_quant"))  # the experts through fused_moe_w8a8
_references: dict = {}
# The tiny models' k/v projections have 64 output features: LMDeploy's AWQ loader needs N % g == 0.
GROUP_SIZE = 64


def _quantized(name, method):
    return quantized_model(name, method, **({} if method == "smooth_quant" else {"group_size": GROUP_SIZE}))


def _reference(folder):
    if folder not in _references:
        _references[folder] = FakeQuantReference(folder)
    return _references[folder]


# The dlinfer op each method's quantised linears call (LMDeploy looks it up on every call).
_LINEAR_OP = {"smooth_quant": "linear_w8a8", "awq": "weight_quant_matmul", "rtn": "weight_quant_matmul"}
_MOE_OP = "fused_moe_w8a8"


@pytest.mark.parametrize("name,method", _CASES)
def test_quantized_greedy_matches_fake_quant_hf(name, method, monkeypatch):
    folder = _quantized(name, method)
    calls, repacked = [], []
    op, repack = getattr(dlinfer.ops, _LINEAR_OP[method]), dlinfer.ops.repack_weight_quant
    monkeypatch.setattr(dlinfer.ops, _LINEAR_OP[method],
                        lambda *a, **k: calls.append(w4_layouts.is_repacked(a[1])) or op(*a, **k))
    monkeypatch.setattr(dlinfer.ops, "repack_weight_quant", lambda *a, **k: repacked.append(1) or repack(*a, **k))
    moe_calls = []
    moe_op = getattr(dlinfer.ops, _MOE_OP)
    monkeypatch.setattr(dlinfer.ops, _MOE_OP, lambda *a, **k: moe_calls.append(a[1].dtype) or moe_op(*a, **k))
    with cpu_pipeline(folder, enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(results, _reference(folder), NEW_TOKENS)
    assert calls, f"{_LINEAR_OP[method]} never ran"
    if name == "mixtral":  # the experts' int8 weights reached the W8A8 MoE op
        assert moe_calls and set(moe_calls) == {torch.int8}, set(moe_calls)
    if method != "smooth_quant":  # the cpu vendor's load-time repack (column_tiled or k_interleaved) reached every call
        assert repacked and set(calls) == {True}, (len(repacked), set(calls))


@pytest.mark.parametrize("name,method", [("llama", "smooth_quant"), ("qwen2", "awq"), ("mixtral", "smooth_quant")])
def test_quantized_graph_mode_matches_fake_quant_hf(name, method):
    """eager_mode=False: decode steps compiled by dlinfer's backend with the quantised ops in them."""
    folder = _quantized(name, method)
    with cpu_pipeline(folder, eager_mode=False, max_batch_size=2, enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(results, _reference(folder), NEW_TOKENS)


def test_awq_group_32_matches_fake_quant_hf():
    """Group 32, which SmolLM2 (K = 576) also allows beside 64: LMDeploy loads it and dlinfer's
    weight_quant_matmul runs it."""
    folder = quantized_model("llama", "awq", group_size=32)
    with cpu_pipeline(folder, enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(results, _reference(folder), NEW_TOKENS)


@pytest.mark.slow
def test_awq_at_tp2_matches_fake_quant_hf():
    """Tensor parallel: each rank process repacks its shard of the 4-bit weights at load (on a CPU
    with VNNI and AMX into k_interleaved, whose kernel asks Linux for the tile state in that
    process) and the greedy tokens still match the fake-quant reference. Group 32: LMDeploy's AWQ
    loader splits a linear's output columns in multiples of the group size, and the tiny model's
    k/v projections have 64 columns."""
    folder = quantized_model("llama", "awq", group_size=32)
    with cpu_pipeline(folder, tp=2, enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(results, _reference(folder), NEW_TOKENS)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graph"])
def test_a_bfloat16_w4a16_engine_gives_the_float32_kernels_tokens(eager, monkeypatch):
    """A W4A16 engine in bfloat16, activations at their own precision: the hook's layout (on a CPU
    with AVX512-BF16 and no AMX, k_interleaved, whose kernel takes the bfloat16 path: float32 sums
    of exact products) gives the same greedy tokens as the same engine on column_tiled (the float32
    kernel), eager and compiled; weight_quant_matmul saw bfloat16 activations on the weights the
    hook chose."""
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    folder = _quantized("llama", "rtn")
    seen = []
    op = dlinfer.ops.weight_quant_matmul
    monkeypatch.setattr(dlinfer.ops, "weight_quant_matmul",
                        lambda *a, **k: seen.append((a[0].dtype, a[1].dtype)) or op(*a, **k))
    tokens = {}
    monkeypatch.setenv("DLINFER_CPU_W4_ACTIVATIONS", "native")  # AVX2 builds' default: the next test
    for layout in ("auto", "column_tiled"):
        monkeypatch.setenv("DLINFER_CPU_W4_LAYOUT", layout)
        seen.clear()
        with cpu_pipeline(folder, dtype="bfloat16", eager_mode=eager, max_batch_size=4,
                          enable_prefix_caching=False) as pipe:
            tokens[layout] = [r.token_ids for r in greedy_generate(pipe, PROMPTS, NEW_TOKENS)]
        ki = layout == "auto" and cpu_w4.VNNI and (cpu_w4.AMX or cpu_w4.BF16_DOT)
        if eager:  # a compiled step calls the vendor through the graph, not dlinfer.ops
            assert set(seen) == {(torch.bfloat16, torch.uint8 if ki else torch.int32)}, set(seen)
    assert tokens["auto"] == tokens["column_tiled"]


BF16_ULPS = 4  # a bfloat16 engine's logit error, in bfloat16 steps at the logits compared (below)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graph"])
def test_a_bfloat16_w4_engine_takes_16_bit_activations_by_default_on_avx2(eager, monkeypatch):
    """An AVX2 build, DLINFER_CPU_W4_ACTIVATIONS unset: a bfloat16 W4A16 engine's linears take
    path 5 (16-bit activations, asked for at every eager call and each compiled call site) on
    k_interleaved weights. Its greedy tokens are not the float kernel's bit for bit: each prompt's
    equal those of the same engine with =native, or where they part, HF (float32, the dequantised
    weights) has the two tokens' logits within BF16_ULPS bfloat16 steps of each other there: a near
    tie that bfloat16's own rounding decides (the engine's logits are rounded to bfloat16, each
    layer's hidden states too), not a fault of the 16-bit rule."""
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    if not cpu_w4.INT16_ACTIVATIONS:
        pytest.skip("16-bit activations are the default on AVX2 builds only")
    folder = _quantized("llama", "rtn")
    paths, weights = [], []
    kernel_path = cpu_w4.kernel_path
    monkeypatch.setattr(cpu_w4, "kernel_path", lambda dtype: paths.append(kernel_path(dtype)) or paths[-1])
    op = dlinfer.ops.weight_quant_matmul
    monkeypatch.setattr(dlinfer.ops, "weight_quant_matmul", lambda *a, **k: weights.append(a[1].dtype) or op(*a, **k))
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    results = {}
    for setting in ("auto", "native"):
        monkeypatch.setenv("DLINFER_CPU_W4_ACTIVATIONS", setting)
        paths.clear()
        with cpu_pipeline(folder, dtype="bfloat16", eager_mode=eager, max_batch_size=4,
                          enable_prefix_caching=False) as pipe:
            results[setting] = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        if setting == "auto":
            assert paths and set(paths) == {cpu_w4.INT16_PATH}, set(paths)
            assert not eager or set(weights) == {torch.uint8}, set(weights)
    reference = FakeQuantReference(folder, int8_head=True).model
    for i, (a, b) in enumerate(zip(results["auto"], results["native"])):
        d = first_difference(a.token_ids, b.token_ids)
        if d == len(a.token_ids):  # both NEW_TOKENS long: equal
            continue
        with torch.inference_mode():
            logits = reference(torch.tensor([a.input_ids + a.token_ids[:d]])).logits[0, -1].double()
        pair = logits[[a.token_ids[d], b.token_ids[d]]]
        step = 2.0 ** (torch.frexp(pair.abs().max()).exponent.item() - 8)  # bfloat16's step at the two logits
        gap = abs(float(pair[0] - pair[1]))
        assert gap <= BF16_ULPS * step, (f"prompt {i}: auto and native part at new token {d} where HF's logits "
                                         f"differ by {gap:.4f} ({gap / step:.2f} bfloat16 steps)")


@pytest.mark.parametrize("head", ["auto", "int4"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graph"])
@pytest.mark.parametrize("bits", ["int8", "int16"])
def test_integer_activations_match_a_reference_that_quantises_them_too(bits, eager, head, monkeypatch):
    """DLINFER_CPU_W4_ACTIVATIONS=int8 / int16: the engine's W4 linears multiply 8- / 16-bit
    activations (path 4 / 5, asked for at every eager call and at each compiled call site), and the
    greedy tokens equal HF running the dequantised weights on inputs quantised per row and group by
    the same rule; with the int4 LM head (a W4 weight too) its input per group of 32 as well."""
    from dlinfer.vendor.cpu import weight_quant as cpu_w4

    if not (cpu_w4.INT8_ACTIVATIONS if bits == "int8" else cpu_w4.INT16_ACTIVATIONS):
        pytest.skip(f"{bits} activations do not run on this CPU or build")
    folder = _quantized("llama", "awq")
    paths = []
    kernel_path = cpu_w4.kernel_path
    monkeypatch.setattr(cpu_w4, "kernel_path", lambda dtype: paths.append(kernel_path(dtype)) or paths[-1])
    monkeypatch.setenv("DLINFER_CPU_W4_ACTIVATIONS", bits)
    monkeypatch.setenv("DLINFER_LM_HEAD", head)
    monkeypatch.delenv("DLINFER_CPU_W4_LAYOUT", raising=False)
    with cpu_pipeline(folder, eager_mode=eager, max_batch_size=2, enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    want = cpu_w4.INT8_PATH if bits == "int8" else cpu_w4.INT16_PATH
    assert paths and set(paths) == {want}, set(paths)
    reference = FakeQuantReference(folder, int8_head=head == "auto", int4_head=head == "int4", activations=bits)
    assert_matches_hf(results, reference, NEW_TOKENS)
