"""Which models dlinfer's device types run, checked before any weight is loaded.

LMDeploy's dlinfer layers accept every model LMDeploy knows, but some of them need ops dlinfer
does not offer (MLA, linear attention, most quantized formats), and a few of those would run
silently wrong rather than fail (dynamic NTK rope depends on the batch; a model whose layers
LMDeploy windows differently from transformers, `check_windows`). So the check is an allowlist:
architectures and rope types whose greedy tokens were compared with HF transformers in
tests/lmdeploy (test_pipeline_greedy.py, test_architectures.py, test_rope_scaling.py), minus
features they may turn on; every refusal names what is refused, why, and what is supported.
Vision-language models (test_vlm.py) are checked on their language model's config (`text_config`);
`check_architecture` alone runs before their image preprocessor is built
(patches/vl_preprocess.py), so an unsupported VLM is refused by name before anything else fails.
"""

from __future__ import annotations

from dlinfer.framework.lmdeploy_ext.devices import DeviceSpec

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset({
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
    "InternLM2ForCausalLM",
    # MLA: one latent KV head, values a slice of it (tests/lmdeploy/test_mla_models.py)
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    # sliding windows and soft-capping (tests/lmdeploy/test_windowed_models.py)
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    # vision-language (tests/lmdeploy/test_vlm.py: images through `pipeline`, token-exact vs HF)
    "InternVLForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "InternVLChatModel",  # remote-code InternVL 1.5 / 2 (InternViT + a Qwen2 language model)
})

# Vision-language architectures among them: their language model's settings live in `text_config`
# (the remote-code InternVL's in `llm_config`).
VISION_LANGUAGE_ARCHITECTURES: frozenset[str] = frozenset({
    "InternVLChatModel",
    "InternVLForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
})

# Architectures whose language model runs Qwen2-VL's chunked multimodal rope (`mrope_section`).
MROPE_ARCHITECTURES: frozenset[str] = frozenset({
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
})

# Architectures refused with a reason of their own (any other unsupported one: "not compared").
REFUSED_ARCHITECTURES: dict[str, str] = {
    "CogVLMForCausalLM": (
        "its tokens cannot be compared with HF transformers offline: transformers 4.57 has no CogVLM, whose "
        "modeling code is remote code on the Hugging Face Hub (THUDM's modeling_cogvlm.py, which also imports "
        "xformers and torchvision), and LMDeploy's CogVLM image preprocessor needs torchvision"),
}


# Rope types (`rope_scaling["rope_type"]`, or the older "type") whose greedy tokens equal HF
# transformers' in tests/lmdeploy/test_rope_scaling.py, with prompts past the original context.
SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3", "yarn"})

_LONGROPE_REASON = (
    "LMDeploy 0.18's dlinfer rotary layer has no LongRoPE branch (it raises NotImplementedError when "
    "the model is built), and LMDeploy's other LongRoPE layer picks the short or long factors by the "
    "longest sequence of the batch, where HF picks them by each sequence's own length")

# Rope types LMDeploy's dlinfer layer accepts but whose tokens would not equal HF's, and why.
REFUSED_ROPE_TYPES: dict[str, str] = {
    "dynamic": (
        "LMDeploy rescales the NTK base of every sequence in a batch by the longest sequence's length, "
        "where HF rescales each sequence by its own length, so a sequence's tokens would depend on what "
        "it is batched with (alone it matches HF; in a batch with a longer prompt it does not)"),
    "longrope": _LONGROPE_REASON,
    "su": _LONGROPE_REASON,  # LongRoPE's older name
}


class UnsupportedModelError(ValueError):
    """The model, or a feature it turns on, cannot run on a dlinfer device type."""


def _window(value) -> int | None:
    """A config's window as attention sees it: an int >= 1, or None (None, -1, 0: none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# Architectures whose LMDeploy 0.18 model passes the config's `sliding_window` to every layer
# (models/mistral.py, phi3.py, qwen3.py, qwen3_moe.py, qwen2_moe.py, mixtral.py).
_EVERY_LAYER_WINDOWED = frozenset({"MistralForCausalLM", "Phi3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                   "Qwen2MoeForCausalLM", "MixtralForCausalLM"})


def lmdeploy_layer_windows(arch: str, hf_config) -> list[int | None]:
    """The sliding window LMDeploy 0.18's model gives each layer's attention (None: global)."""
    n = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    window = _window(getattr(hf_config, "sliding_window", None))
    if arch in _EVERY_LAYER_WINDOWED:
        return [window] * n
    if arch == "Qwen2ForCausalLM":  # models/qwen2.py: every layer, when use_sliding_window
        return [window if getattr(hf_config, "use_sliding_window", False) else None] * n
    if arch in ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):  # models/gemma.py
        if getattr(hf_config, "model_type", None) == "gemma3_text":
            pattern = getattr(hf_config, "sliding_window_pattern", 6)
            return [window if (i + 1) % pattern else None for i in range(n)]
        return [None if i % 2 else window for i in range(n)]
    return [None] * n  # the others pass no window


# Architectures whose transformers 4.57 model masks every layer with the config's `sliding_window`
# when it is set, whatever `layer_types` a config.json carries (it keeps them as plain attributes).
_HF_EVERY_LAYER_WINDOWED = frozenset({"MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"})


def hf_layer_windows(arch: str, hf_config) -> list[int | None]:
    """The sliding window transformers 4.57 gives each layer: the config's `sliding_window` on every
    layer for Mistral, Phi-3 and Mixtral; `layer_types` where the config has them (Qwen2, Qwen3,
    Gemma 2/3, ...); else none (a Llama config's `sliding_window`, if any, is not read)."""
    n = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    window = _window(getattr(hf_config, "sliding_window", None))
    if arch in _HF_EVERY_LAYER_WINDOWED:
        return [window] * n
    types = getattr(hf_config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == n:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window if arch in _EVERY_LAYER_WINDOWED else None] * n


def check_windows(hf_config, arch: str, where: str) -> None:
    """Raise UnsupportedModelError unless LMDeploy windows the same layers, by the same amount, as
    transformers (the attention layer runs whatever LMDeploy's model asks for:
    scored_attention.py)."""
    ours, theirs = lmdeploy_layer_windows(arch, hf_config), hf_layer_windows(arch, hf_config)
    if ours != theirs:
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with these sliding windows: LMDeploy 0.18's model windows layers "
            f"{differ} as {[ours[i] for i in differ]} where transformers uses {[theirs[i] for i in differ]} "
            "(None: no window), so the tokens would differ; e.g. Qwen2 with use_sliding_window runs only "
            "with max_window_layers=0.")


def rope_parameters(hf_config) -> dict | None:
    """The model's rope scaling dict, where LMDeploy reads it (transformers v5 `rope_parameters` first)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = getattr(hf_config, "rope_scaling", None)
    return params if isinstance(params, dict) else None


def rope_type(hf_config) -> str:
    """The rope type LMDeploy builds for the model ('default' without rope scaling)."""
    params = rope_parameters(hf_config) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def _check_rope(hf_config, arch: str, where: str) -> None:
    kind = rope_type(hf_config)
    params = rope_parameters(hf_config) or {}
    if arch in MROPE_ARCHITECTURES and "mrope_section" in params:
        # Qwen2-VL's own: chunked sections over default frequencies (older configs say "mrope",
        # which transformers reads as "default").
        if params.get("mrope_interleaved") or kind not in ("default", "mrope"):
            raise UnsupportedModelError(
                f"{where} cannot run multimodal rope with rope_type={kind!r}, mrope_interleaved="
                f"{bool(params.get('mrope_interleaved'))} ({arch}): not compared with HF transformers on dlinfer "
                "device types (chunked mrope over default frequencies runs).")
        kind = "default"
        params = {k: v for k, v in params.items() if k != "mrope_section"}
    if kind not in SUPPORTED_ROPE_TYPES:
        reason = REFUSED_ROPE_TYPES.get(kind, "not compared with HF transformers on dlinfer device types")
        raise UnsupportedModelError(
            f"{where} cannot run rope_type={kind!r} ({arch}): {reason}. "
            f"Supported rope types: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}.")
    if "mrope_section" in params or any(key.startswith("fope") for key in params):
        raise UnsupportedModelError(
            f"{where} cannot run multimodal (mrope) or Fourier (fope) rotary embeddings ({arch}).")
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is None:
        partial = params.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise UnsupportedModelError(
            f"{where} cannot run partial rotary embeddings ({arch}, partial_rotary_factor={partial}): "
            "not compared with HF transformers on dlinfer device types.")


def _check_gemma(hf_config, arch: str, where: str) -> None:
    """LMDeploy 0.18's Gemma (models/gemma.py, also Gemma 2 and 3) always ties the LM head to the
    embeddings and always runs tanh-approximated GELU, where HF transformers 4.57 reads
    `tie_word_embeddings` and the activation (Gemma: `hidden_act`; Gemma 2/3: `hidden_activation`):
    only checkpoints on which both agree run."""
    if not getattr(hf_config, "tie_word_embeddings", True):
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with tie_word_embeddings=False: LMDeploy's Gemma ignores the "
            "checkpoint's lm_head and reuses the input embeddings.")
    declared = getattr(hf_config, "hidden_activation", None)
    act = getattr(hf_config, "hidden_act", None) if arch == "GemmaForCausalLM" else declared
    if act != "gelu_pytorch_tanh" or declared not in (None, "gelu_pytorch_tanh"):
        field = "hidden_act" if arch == "GemmaForCausalLM" else "hidden_activation"
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with hidden_act={getattr(hf_config, 'hidden_act', None)!r}, "
            f"hidden_activation={declared!r}: LMDeploy's Gemma always runs tanh-approximated GELU "
            f"('gelu_pytorch_tanh', Gemma's reference activation), HF transformers runs `{field}`. Set {field} to "
            "'gelu_pytorch_tanh' in config.json to run it.")


def _check_internlm2(hf_config, arch: str, where: str) -> None:
    """InternLM2 checkpoints have no QKV/output biases; the grouped-`wqkv` split of a bias is untested."""
    if getattr(hf_config, "bias", False):
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with bias=True: not compared with HF on dlinfer device types.")


def check_internvl_chat(top, where: str) -> None:
    """The remote-code InternVL (`InternVLChatModel`, InternVL 1.5 / 2) as tested: a Qwen2 or
    InternLM2 language model (checked as that architecture is), dynamic tiles (the preprocessing
    patches/vl_preprocess.py builds without torchvision), pixel shuffle v2, the last vision layer,
    and one `tie_word_embeddings` (LMDeploy ties the LM head by the top-level value, a
    PretrainedConfig's default being True)."""
    arch = "InternVLChatModel"
    llm = getattr(top, "llm_config", None)
    llm_arch = (list(getattr(llm, "architectures", None) or []) or ["?"])[0]
    if llm_arch not in ("Qwen2ForCausalLM", "InternLM2ForCausalLM"):
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with a {llm_arch} language model: compared with HF transformers are the "
            "Qwen2 (InternVL2-1B) and InternLM2 (InternVL 1.5, InternVL2-2B/8B/26B) ones.")
    extra = _ARCHITECTURE_CHECKS.get(llm_arch)
    if extra is not None:
        extra(llm, f"{arch}'s {llm_arch}", where)
    if not getattr(top, "dynamic_image_size", False):
        raise UnsupportedModelError(
            f"{where} cannot run {arch} without dynamic_image_size (InternVL-Chat-V1-1/1-2's CLIP preprocessing): "
            "compared with HF transformers is the dynamic-tile preprocessing of InternVL 1.5 / 2.")
    if getattr(top, "ps_version", "v1") != "v2" or getattr(top, "select_layer", -1) != -1 \
            or getattr(top, "flash_mode", None) is not None:
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with ps_version={getattr(top, 'ps_version', 'v1')!r}, select_layer="
            f"{getattr(top, 'select_layer', -1)!r}, flash_mode={getattr(top, 'flash_mode', None)!r}: LMDeploy runs "
            "pixel shuffle v2 on the last vision layer; only that is compared with HF transformers.")
    if bool(getattr(top, "tie_word_embeddings", True)) != bool(getattr(llm, "tie_word_embeddings", False)):
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with tie_word_embeddings={getattr(top, 'tie_word_embeddings', True)!r} at the "
            f"top of config.json and {getattr(llm, 'tie_word_embeddings', False)!r} in llm_config: LMDeploy ties the "
            "LM head by the top-level value; set both to the language model's.")


def _check_deepseek(hf_config, arch: str, where: str) -> None:
    """LMDeploy 0.18's DeepSeek model (models/deepseek_v2.py) reads keys DeepSeek's own configs
    carry and transformers' do not (a transformers-format config crashed it with an AttributeError),
    routes by `topk_method`, and scales V2's attention by YaRN's mscale where transformers 4.57's
    DeepseekV2 does not."""
    missing = [key for key in ("moe_layer_freq", "scoring_func") if not hasattr(hf_config, key)]
    if missing:
        raise UnsupportedModelError(
            f"{where} cannot run {arch} without {', '.join(missing)} in config.json: LMDeploy's DeepSeek model "
            "reads them (DeepSeek's checkpoints carry them; transformers' configs do not). For the meaning "
            "transformers gives such a checkpoint, add \"moe_layer_freq\": 1 and \"scoring_func\": \"softmax\" "
            "(DeepSeek-V2) or \"sigmoid\" (DeepSeek-V3).")
    method = getattr(hf_config, "topk_method", "greedy")
    if method == "group_limited_greedy":
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with topk_method='group_limited_greedy' (DeepSeek-V2 and V2-Chat): LMDeploy "
            "0.18 masks the router logits of the groups left out with 0 and takes a softmax over what remains, where "
            "DeepSeek's code and transformers take the softmax first, mask the scores and keep those weights, so "
            "experts and weights differ (greedy, as DeepSeek-V2-Lite, and DeepSeek-V3's noaux_tc run).")
    if method not in ("greedy", "noaux_tc") or getattr(hf_config, "moe_layer_freq") != 1:
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with topk_method={method!r}, moe_layer_freq="
            f"{getattr(hf_config, 'moe_layer_freq')!r}: compared with HF transformers are greedy and noaux_tc "
            "routing with every layer from first_k_dense_replace on an MoE layer (moe_layer_freq=1).")
    if arch == "DeepseekV2ForCausalLM" and rope_type(hf_config) == "yarn":
        raise UnsupportedModelError(
            f"{where} cannot run {arch} with YaRN rope scaling: LMDeploy (as DeepSeek's own code) multiplies the "
            "softmax scale by YaRN's mscale_all_dim factor, transformers 4.57's DeepseekV2 does not, so the tokens "
            "cannot be compared with HF (DeepSeek-V3 with YaRN runs).")


# Architectures whose LMDeploy model passes `attn_logit_softcapping` to its attention (models/gemma.py).
_SOFTCAPPED = frozenset({"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"})

# Checks of one architecture beyond the common ones (what LMDeploy's model hard-codes).
_ARCHITECTURE_CHECKS = {
    "GemmaForCausalLM": _check_gemma,
    "Gemma2ForCausalLM": _check_gemma,
    "Gemma3ForCausalLM": _check_gemma,
    "InternLM2ForCausalLM": _check_internlm2,
    "DeepseekV2ForCausalLM": _check_deepseek,
    "DeepseekV3ForCausalLM": _check_deepseek,
}


def architecture(hf_config) -> str:
    """The architecture LMDeploy builds for a HF config (its first `architectures` entry)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    return architectures[0] if architectures else type(hf_config).__name__


def check_architecture(arch: str, spec: DeviceSpec) -> None:
    """Raise UnsupportedModelError unless `spec` runs architecture `arch`."""
    if arch not in SUPPORTED_ARCHITECTURES:
        reason = REFUSED_ARCHITECTURES.get(arch)
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(
            f"device_type={spec.device_type!r} cannot run architecture {arch!r}"
            + (f" ({reason})" if reason else "") + f"; supported: {supported}.")


def check_model(model_config, spec: DeviceSpec) -> None:
    """Raise UnsupportedModelError unless `model_config` (LMDeploy's ModelConfig) runs on `spec`."""
    where = f"device_type={spec.device_type!r}"
    top = model_config.hf_config
    arch = architecture(top)
    check_architecture(arch, spec)
    if arch == "InternVLChatModel":
        check_internvl_chat(top, f"device_type={spec.device_type!r}")
    # A VLM's language model: its rope, window, soft-capping and quantization are checked there.
    hf_config = top
    if arch in VISION_LANGUAGE_ARCHITECTURES:
        hf_config = getattr(top, "text_config", None) or getattr(top, "llm_config", None) or top
    quant = getattr(top, "quantization_config", None) or getattr(hf_config, "quantization_config", None)
    if quant:
        check_quantization(quant, arch, where)
    check_windows(hf_config, arch, where)
    if getattr(hf_config, "attn_logit_softcapping", None) and arch not in _SOFTCAPPED:
        raise UnsupportedModelError(f"{where} cannot run attention logit soft-capping ({arch}): LMDeploy 0.18's "
                                    "model for it does not pass the cap to its attention.")
    _check_rope(hf_config, arch, where)
    extra = _ARCHITECTURE_CHECKS.get(arch)
    if extra is not None:
        extra(hf_config, arch, where)


# Quantised checkpoints (docs/quantize.md): `quant_method` -> architectures whose greedy tokens
# equal HF transformers' running the dequantised (fake-quant) model, tests/lmdeploy/test_quantized.py.
QUANTIZED_ARCHITECTURES: dict[str, frozenset[str]] = {
    "smooth_quant": frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"}),
    "awq": frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"}),
}
# Methods refused by name, and why.
REFUSED_QUANT_METHODS: dict[str, str] = {
    "gptq": "dlinfer has no GPTQ linear op (LMDeploy's dlinfer layers have none either)",
    "fp8": "dlinfer has no fp8 linear ops",
    "compressed-tensors": "dlinfer has no op for LMDeploy's compressed-tensors linears",
    "bitsandbytes": "LMDeploy 0.18's PyTorch engine does not load bitsandbytes checkpoints",
    "modelslim": "ModelSlim checkpoints are not run end to end here (the op linear_w8a8_static exists; no "
                 "checkpoint to compare with)",
}


def check_quantization(quant, arch: str, where: str) -> None:
    """Raise UnsupportedModelError unless the checkpoint's `quantization_config` is one that runs:
    AWQ 4-bit "gemm" with zero points, or SmoothQuant int8, for the architectures tested with it."""
    if not isinstance(quant, dict):
        quant = getattr(quant, "to_dict", lambda: {"quant_method": type(quant).__name__})()
    method = str(quant.get("quant_method", "?")).lower()
    head = f"{where} cannot run quant_method={method!r} ({arch})"
    if method not in QUANTIZED_ARCHITECTURES:
        reason = REFUSED_QUANT_METHODS.get(method, "not supported by dlinfer")
        raise UnsupportedModelError(f"{head}: {reason}. Supported: awq (4-bit gemm, zero point), smooth_quant "
                                    "(int8), e.g. made by `python -m dlinfer quantize` (docs/quantize.md).")
    if arch not in QUANTIZED_ARCHITECTURES[method]:
        raise UnsupportedModelError(f"{head}: not compared with HF transformers for this architecture; supported: "
                                    f"{', '.join(sorted(QUANTIZED_ARCHITECTURES[method]))}.")
    if method == "smooth_quant" and str(quant.get("quant_dtype", "int8")) != "int8":
        raise UnsupportedModelError(f"{head}: quant_dtype={quant.get('quant_dtype')!r}; only int8 runs.")
    if method == "awq":
        bits, version = quant.get("bits", 4), str(quant.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or quant.get("zero_point", True) is not True:
            raise UnsupportedModelError(
                f"{head}: bits={bits}, version={version!r}, zero_point={quant.get('zero_point', True)!r}; only "
                "4-bit 'gemm' with zero points runs (the layout dlinfer's weight_quant_matmul reads).")


def check_engine_features(spec: DeviceSpec, *, specdecode_config, memdecode_config) -> None:
    """Raise UnsupportedModelError for engine features the device type does not run."""
    where = f"device_type={spec.device_type!r}"
    if specdecode_config is not None:
        raise UnsupportedModelError(f"{where} does not run speculative decoding.")
    if memdecode_config is not None:
        raise UnsupportedModelError(f"{where} does not run MemDecode.")
