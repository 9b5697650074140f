"""What dlinfer's device types accept before weights load (`backend/model_support.py`), and the
rotary layers the ops backend builds (`backend/rotary.py`). No engine: configs only, fast."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import dlinfer.framework.lmdeploy_ext  # noqa: F401
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend import model_support
from dlinfer.framework.lmdeploy_ext.backend.model_support import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    check_model,
)
from dlinfer.framework.lmdeploy_ext.backend.op_backend import CpuOpsBackend

# What each architecture's tested checkpoints set (and its real ones do).
_ARCH_DEFAULTS = {"GemmaForCausalLM": dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
                  "Gemma2ForCausalLM": dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
                  "Gemma3ForCausalLM": dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
                  "DeepseekV2ForCausalLM": dict(moe_layer_freq=1, scoring_func="softmax", topk_method="greedy"),
                  "InternVLChatModel": dict(llm_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"],
                                                                       max_position_embeddings=1024,
                                                                       tie_word_embeddings=False),
                                            dynamic_image_size=True, ps_version="v2", select_layer=-1,
                                            tie_word_embeddings=False),
                  "DeepseekV3ForCausalLM": dict(moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc")}


def _model_config(arch="LlamaForCausalLM", **hf):
    hf = {**_ARCH_DEFAULTS.get(arch, {}), **hf}
    hf_config = SimpleNamespace(architectures=[arch], max_position_embeddings=1024, **hf)
    return SimpleNamespace(hf_config=hf_config, sliding_window=hf.get("sliding_window", -1))


def _refused(model_config, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        check_model(model_config, devices.CPU)


@pytest.mark.parametrize("arch", sorted(SUPPORTED_ARCHITECTURES))
def test_supported_architectures_pass(arch):
    check_model(_model_config(arch), devices.CPU)


def test_refusal_lists_what_is_supported():
    _refused(_model_config("Starcoder2ForCausalLM"),
             "device_type='cpu' cannot run architecture 'Starcoder2ForCausalLM'; supported: "
             + ", ".join(sorted(SUPPORTED_ARCHITECTURES)) + ".")


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {"type": "linear", "factor": 2.0},  # the older key
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
])
def test_tested_rope_types_pass(rope_scaling):
    check_model(_model_config(rope_scaling=rope_scaling), devices.CPU)


@pytest.mark.parametrize("rope_scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic' (LlamaForCausalLM): LMDeploy rescales"),
    ({"type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope_type='longrope'"),
    ({"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, "rope_type='su'"),
    ({"rope_type": "mrope", "mrope_section": [8, 12, 12]},
     "rope_type='mrope' (LlamaForCausalLM): not compared with HF transformers"),
    ({"rope_type": "default", "mrope_section": [8, 12, 12]}, "cannot run multimodal (mrope)"),
])
def test_other_rope_types_are_refused_by_name(rope_scaling, message):
    _refused(_model_config(rope_scaling=rope_scaling), message)
    if "rope_type=" in message:
        _refused(_model_config(rope_scaling=rope_scaling), "Supported rope types: default, linear, llama3, yarn.")


def test_transformers_v5_rope_parameters_are_read():
    config = _model_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    _refused(config, "rope_type='dynamic'")


def test_partial_rotary_is_refused():
    _refused(_model_config("LlamaForCausalLM", partial_rotary_factor=0.75),
             "cannot run partial rotary embeddings (LlamaForCausalLM, partial_rotary_factor=0.75)")
    check_model(_model_config("LlamaForCausalLM", partial_rotary_factor=1.0), devices.CPU)


@pytest.mark.parametrize("arch,hf", [
    ("Phi3ForCausalLM", dict(sliding_window=255)),
    ("MistralForCausalLM", dict(sliding_window=4096)),
    ("MixtralForCausalLM", dict(sliding_window=64)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64,
                              layer_types=["sliding_attention"] * 4)),
    ("Gemma2ForCausalLM", dict(sliding_window=64, attn_logit_softcapping=50.0,
                               layer_types=["sliding_attention", "full_attention"] * 2)),
    ("Gemma3ForCausalLM", dict(model_type="gemma3_text", sliding_window=64,
                               layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2)),
    ("LlamaForCausalLM", dict(sliding_window=64)),  # transformers' Llama does not read it; LMDeploy's neither
])
def test_windows_lmdeploy_gives_the_layers_transformers_gives_run(arch, hf):
    check_model(_model_config(arch, num_hidden_layers=len(hf.get("layer_types", [0] * 4)), **hf), devices.CPU)


@pytest.mark.parametrize("arch,hf,message", [
    # transformers windows layers >= max_window_layers only; LMDeploy's Qwen2 windows every layer
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64,
                              layer_types=["full_attention"] + ["sliding_attention"] * 3),
     "LMDeploy 0.18's model windows layers [0] as [64] where transformers uses [None]"),
    # LMDeploy's Gemma 3 windows 5 of every 6 layers whatever layer_types says
    ("Gemma3ForCausalLM", dict(model_type="gemma3_text", sliding_window=64,
                               layer_types=["sliding_attention", "full_attention"] * 2),
     "windows layers [1, 3] as [64, 64] where transformers uses [None, None]"),
])
def test_windows_lmdeploy_would_put_elsewhere_are_refused(arch, hf, message):
    _refused(_model_config(arch, num_hidden_layers=len(hf["layer_types"]), **hf), message)


def test_soft_capping_runs_only_where_lmdeploy_passes_it():
    _refused(_model_config("LlamaForCausalLM", attn_logit_softcapping=30.0),
             "cannot run attention logit soft-capping (LlamaForCausalLM): LMDeploy 0.18's model for it does not pass")
    check_model(_model_config("Gemma2ForCausalLM", attn_logit_softcapping=30.0), devices.CPU)


def test_only_models_windowing_every_layer_let_lmdeploy_free_old_blocks():
    """patches/window_cache.py: LMDeploy frees the KV blocks before its cache window; a model with
    global layers (Gemma 2/3), or whose config's window its attention ignores (a Llama config with
    one: LMDeploy's default builder still sets the cache window), must keep them."""
    from dlinfer.framework.lmdeploy_ext.patches.window_cache import frees_needed_history

    gemma3 = _model_config("Gemma3ForCausalLM", model_type="gemma3_text", sliding_window=64, num_hidden_layers=6)
    gemma2 = _model_config("Gemma2ForCausalLM", sliding_window=64, num_hidden_layers=2)
    llama_with_window = _model_config("LlamaForCausalLM", sliding_window=64, num_hidden_layers=2)
    mistral = _model_config("MistralForCausalLM", sliding_window=64, num_hidden_layers=2)
    llama = _model_config("LlamaForCausalLM", num_hidden_layers=2)
    assert frees_needed_history(gemma3) and frees_needed_history(gemma2) and frees_needed_history(llama_with_window)
    assert not frees_needed_history(mistral) and not frees_needed_history(llama)


def test_mistral_windows_every_layer_whatever_layer_types_says():
    """transformers' Mistral keeps a config.json's `layer_types` as a plain attribute and windows
    every layer, as LMDeploy's does: no refusal."""
    check_model(_model_config("MistralForCausalLM", sliding_window=64, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"]), devices.CPU)


@pytest.mark.parametrize("hf,message", [
    (dict(tie_word_embeddings=False), "cannot run GemmaForCausalLM with tie_word_embeddings=False"),
    (dict(hidden_act="gelu"), "cannot run GemmaForCausalLM with hidden_act='gelu', hidden_activation=None"),
    (dict(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"), "HF transformers runs `hidden_act`"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
])
def test_gemma_that_lmdeploy_would_run_differently_is_refused(hf, message):
    _refused(_model_config("GemmaForCausalLM", **hf), message)


@pytest.mark.parametrize("arch,hf,message", [
    ("DeepseekV2ForCausalLM", dict(moe_layer_freq=None), "without moe_layer_freq in config.json"),
    ("DeepseekV3ForCausalLM", dict(scoring_func=None), "without scoring_func in config.json"),
    ("DeepseekV2ForCausalLM", dict(moe_layer_freq=2), "moe_layer_freq=2"),
    ("DeepseekV3ForCausalLM", dict(topk_method="sinkhorn"), "topk_method='sinkhorn'"),
    ("DeepseekV2ForCausalLM", dict(topk_method="group_limited_greedy"),
     "topk_method='group_limited_greedy' (DeepSeek-V2 and V2-Chat): LMDeploy 0.18 masks the router logits"),
    ("DeepseekV2ForCausalLM", dict(rope_scaling=dict(type="yarn", factor=40.0, mscale_all_dim=0.707)),
     "cannot run DeepseekV2ForCausalLM with YaRN rope scaling: LMDeploy (as DeepSeek's own code) multiplies"),
])
def test_deepseek_configs_lmdeploy_reads_otherwise_are_refused(arch, hf, message):
    config = _model_config(arch, **{k: v for k, v in hf.items() if v is not None})
    for key in (k for k, v in hf.items() if v is None):
        delattr(config.hf_config, key)
    _refused(config, message)


def test_deepseek_v3_with_yarn_runs():
    check_model(_model_config("DeepseekV3ForCausalLM", rope_scaling=dict(type="yarn", factor=40.0,
                                                                         mscale_all_dim=1.0)), devices.CPU)


def test_internlm2_with_biases_is_refused():
    _refused(_model_config("InternLM2ForCausalLM", bias=True), "cannot run InternLM2ForCausalLM with bias=True")
    check_model(_model_config("InternLM2ForCausalLM", bias=False), devices.CPU)


def test_llama3_rotary_uses_the_original_context():
    """The CPU backend's Llama 3 frequencies are HF's; LMDeploy's own dlinfer backend is untouched."""
    from lmdeploy.pytorch.backends.dlinfer.op_backend import DlinferOpsBackend
    from lmdeploy.pytorch.backends.rotary_embedding import Llama3Parameters, RopeType, RotaryEmbeddingBuildSpec
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64)
    hf = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=1024, rope_scaling=rope_scaling)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    spec = RotaryEmbeddingBuildSpec(dim=32, max_position_embeddings=1024, base=10000, scaling_factor=8.0,
                                    llama3_params=Llama3Parameters(1.0, 4.0, 64), emb_type=RopeType.Llama3)
    torch.testing.assert_close(CpuOpsBackend.build_op(spec).inv_freq, expected, rtol=0, atol=0)
    assert not torch.equal(DlinferOpsBackend.build_op(spec).inv_freq, expected)  # LMDeploy 0.18.0's own


def test_other_rope_types_take_lmdeploys_dlinfer_layers():
    from lmdeploy.pytorch.backends.dlinfer.op_backend import DlinferOpsBackend
    from lmdeploy.pytorch.backends.rotary_embedding import RopeType, RotaryEmbeddingBuildSpec

    spec = RotaryEmbeddingBuildSpec(dim=32, scaling_factor=2.0, emb_type=RopeType.LinearScaling)
    assert type(CpuOpsBackend.build_op(spec)) is type(DlinferOpsBackend.build_op(spec))


def test_every_refused_rope_type_has_a_reason():
    assert set(model_support.REFUSED_ROPE_TYPES) == {"dynamic", "longrope", "su"}
    assert not set(model_support.REFUSED_ROPE_TYPES) & model_support.SUPPORTED_ROPE_TYPES


# Quantised checkpoints (docs/quantize.md): exactly what tests/lmdeploy/test_quantized.py runs.
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"])
def test_smooth_quant_int8_passes(arch):
    check_model(_model_config(arch, quantization_config={"quant_method": "smooth_quant", "quant_dtype": "int8"}),
                devices.CPU)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 4}, "cannot run quant_method='gptq' (LlamaForCausalLM): dlinfer has no GPTQ"),
    ({"quant_method": "fp8"}, "quant_method='fp8' (LlamaForCausalLM): dlinfer has no fp8 linear ops"),
    ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({"quant_method": "hqq"}, "quant_method='hqq' (LlamaForCausalLM): not supported by dlinfer"),
    ({"quant_method": "smooth_quant", "quant_dtype": "float8_e4m3fn"}, "quant_dtype='float8_e4m3fn'; only int8"),
])
def test_quantization_methods_refused_by_name(quant, message):
    _refused(_model_config(quantization_config=quant), message)


def test_smooth_quant_refused_for_untested_architectures():
    _refused(_model_config("Qwen3MoeForCausalLM", quantization_config={"quant_method": "smooth_quant"}),
             "cannot run quant_method='smooth_quant' (Qwen3MoeForCausalLM): not compared with HF")


def test_awq_refused_for_moe():
    _refused(_model_config("MixtralForCausalLM", quantization_config={"quant_method": "awq", "bits": 4}),
             "cannot run quant_method='awq' (MixtralForCausalLM): not compared with HF")


@pytest.mark.parametrize("quant,message", [
    ({"bits": 8}, "bits=8"), ({"version": "gemv"}, "version='gemv'"), ({"zero_point": False}, "zero_point=False"),
])
def test_awq_other_than_4bit_gemm_with_zeros_refused(quant, message):
    config = _model_config(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128, **quant})
    _refused(config, message)


def test_awq_4bit_gemm_with_zero_points_accepted():
    config = _model_config(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128,
                                                "zero_point": True, "version": "gemm"})
    check_model(config, devices.CPU)


def test_the_attention_layer_carries_the_window_and_cap_only_where_set():
    """backend/scored_attention.py: LMDeploy's dlinfer layer for plain attention; its own layer,
    calling the ops with the window and cap, where either is set; a (left, right) window refused."""
    from lmdeploy.pytorch.backends.attention import PagedAttentionBuildSpec

    from dlinfer.framework.lmdeploy_ext.backend.scored_attention import build_scored_attention, window_of

    def spec(window, cap):
        return PagedAttentionBuildSpec(num_heads=4, head_dim=32, scale=None, num_kv_heads=2, v_head_dim=32,
                                       alibi=False, sliding_window=window, logit_softcapping=cap, causal=True,
                                       use_flash_mla=False, mla_index_topk=None, learnable_sink=False,
                                       block_sparse_size=1)

    assert build_scored_attention(spec(None, 0.0)) is None and build_scored_attention(spec(-1, None)) is None
    layer = build_scored_attention(spec(7, 0.0))
    assert layer.paged_attention_fwd.keywords == {"sliding_window": 7, "logit_softcapping": None}
    assert type(CpuOpsBackend.build_op(spec(-1, 50.0))) is type(layer)
    assert CpuOpsBackend.build_op(spec(-1, 50.0)).paged_attention_fwd.keywords["logit_softcapping"] == 50.0
    assert window_of(0) is None and window_of(True) is None
    with pytest.raises(ValueError, match="one int"):
        window_of((6, 0))
