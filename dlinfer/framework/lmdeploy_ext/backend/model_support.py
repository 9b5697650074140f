"""Which models dlinfer's device types run, checked before any weight is loaded.

LMDeploy's dlinfer layers accept every model LMDeploy knows, but some of them need ops dlinfer
does not offer (MLA, linear attention, quantized weights, sliding windows, soft-capping), and a
few of those would run silently wrong rather than fail (the dlinfer attention layer ignores its
`sliding_window` argument). So the check is an allowlist: architectures whose greedy tokens
were compared with HF transformers in tests/lmdeploy, minus features they may turn on.
"""

from __future__ import annotations

from dlinfer.framework.lmdeploy_ext.devices import DeviceSpec

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset({
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
})


class UnsupportedModelError(ValueError):
    """The model, or a feature it turns on, cannot run on a dlinfer device type."""


def _sliding_window(model_config) -> int:
    window = getattr(model_config, "sliding_window", -1)
    return window if isinstance(window, int) else -1


def check_model(model_config, spec: DeviceSpec) -> None:
    """Raise UnsupportedModelError unless `model_config` (LMDeploy's ModelConfig) runs on `spec`."""
    hf_config = model_config.hf_config
    where = f"device_type={spec.device_type!r}"
    architectures = list(getattr(hf_config, "architectures", None) or [])
    arch = architectures[0] if architectures else type(hf_config).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where} cannot run architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}.")
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        raise UnsupportedModelError(f"{where} cannot run quantized checkpoints ({arch}, quant_method={method!r}).")
    window = _sliding_window(model_config)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if window > 0 and (max_positions is None or window < max_positions):
        raise UnsupportedModelError(
            f"{where} cannot run sliding-window attention ({arch}, sliding_window={window} < "
            f"max_position_embeddings={max_positions}).")
    if getattr(hf_config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(f"{where} cannot run attention logit soft-capping ({arch}).")


def check_engine_features(spec: DeviceSpec, *, specdecode_config, memdecode_config) -> None:
    """Raise UnsupportedModelError for engine features the device type does not run."""
    where = f"device_type={spec.device_type!r}"
    if specdecode_config is not None:
        raise UnsupportedModelError(f"{where} does not run speculative decoding.")
    if memdecode_config is not None:
        raise UnsupportedModelError(f"{where} does not run MemDecode.")
