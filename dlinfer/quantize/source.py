"""The SRC folder: checked before anything is loaded, then loaded with transformers, in float32 or
in its own dtype with the layers widened to float32 one at a time."""

from __future__ import annotations

from pathlib import Path

# Architectures whose decoder layer this package knows (names of the norms and linears, below)
# and whose quantised checkpoints were compared with HF on LMDeploy's CPU device type.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")
# Mixture-of-experts architectures among them: smooth_quant only (LMDeploy 0.18 builds its
# quantised fused MoE for smooth_quant and fp8, not for AWQ).
MOE_ARCHITECTURES = ("MixtralForCausalLM",)


class QuantizeInputError(ValueError):
    """SRC, DST or an option of `python -m dlinfer quantize` cannot be used."""


class UnsupportedCheckpointError(QuantizeInputError):
    """SRC is a checkpoint this command does not quantise (its architecture, or already quantised)."""


def read_config(src: Path) -> dict:
    """SRC's config.json, after checking that SRC is a HF checkpoint folder (config, tokenizer,
    untruncated weights: dlinfer/utils/model_folder.py) of a supported model."""
    from dlinfer.utils.model_folder import ModelFolderError, check_model_folder

    try:
        config = check_model_folder(src, "quantize: SRC")
    except ModelFolderError as exc:
        raise QuantizeInputError(str(exc)) from None
    arch = (config.get("architectures") or ["?"])[0]
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise UnsupportedCheckpointError(f"quantize: SRC is already quantised (quant_method={method!r}); "
                                         "start from the "
                               "float checkpoint.")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(f"quantize: architecture {arch!r} is not supported (supported: "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)}); other families are not quantised "
                               "by this command.")
    return config


def check_dense(config: dict, method: str) -> None:
    """AWQ/RTN 4-bit checkpoints of a MoE model would not load: LMDeploy 0.18 has no 4-bit fused MoE."""
    arch = config["architectures"][0]
    if arch in MOE_ARCHITECTURES:
        raise UnsupportedCheckpointError(f"quantize: --method {method} is not supported for the MoE architecture "
                                         f"{arch!r}: LMDeploy 0.18 builds no 4-bit fused MoE (its quantised MoE "
                                         "layers are smooth_quant and fp8); use --method smooth_quant.")


GROUP_SIZES = (128, 64, 32)  # the default group size is the largest of these that fits


def linear_shapes(config: dict) -> dict:
    """{linear: (K, N)} of a decoder layer's quantised linears, from config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def _fitting_group_sizes(config: dict) -> list:
    return [g for g in GROUP_SIZES if all(k % g == 0 and n % g == 0 for k, n in linear_shapes(config).values())]


def default_group_size(config: dict) -> int:
    """The largest of GROUP_SIZES that divides every quantised linear's K and N (what
    `check_group_size` requires); QuantizeInputError when none does."""
    fits = _fitting_group_sizes(config)
    if not fits:
        shapes = ", ".join(f"{name} {k}x{n}" for name, (k, n) in linear_shapes(config).items())
        raise QuantizeInputError(f"quantize: none of the group sizes {', '.join(map(str, GROUP_SIZES))} divides "
                                 f"every linear's K and N ({shapes}); pass --group-size (a multiple of 8 that "
                                 "does).")
    return fits[0]


def check_group_size(config: dict, group_size: int) -> None:
    """Every AWQ linear needs K % group_size == 0 and N % group_size == 0 (LMDeploy's loader)."""
    if group_size <= 0 or group_size % 8:
        raise QuantizeInputError(f"quantize: --group-size must be a positive multiple of 8, got {group_size}.")
    fits = _fitting_group_sizes(config)
    hint = f"; try --group-size {fits[0]}" if fits else ""
    for name, (k, n) in linear_shapes(config).items():
        if k % group_size:
            raise QuantizeInputError(f"quantize: {name} has K={k} input features, not divisible by --group-size "
                                     f"{group_size}{hint}.")
        if n % group_size:
            # LMDeploy's AWQ loader splits merged linears (qkv, gate_up) in chunks of the group
            # size (nn/linear/awq.py weight_loader -> chunk_aligned), even on one device.
            raise QuantizeInputError(f"quantize: {name} has N={n} output features, not divisible by --group-size "
                                     f"{group_size}, which LMDeploy's AWQ loader requires{hint}.")


def load_dtype(config: dict, whole_model_in_float32: bool):
    """The dtype SRC is loaded in: float32 when the whole model must run in float32 (AWQ's tuning
    backpropagates through it), else the checkpoint's own floating dtype, its layers widened to
    float32 one at a time as they are quantised (`widen_layer`): a bf16 8B model needs 16 GB that
    way, not 32."""
    import torch

    if whole_model_in_float32:
        return torch.float32
    stored = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "float32"), None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32


def load(src: Path, dtype=None):
    """(model, tokenizer): SRC on the CPU in eval mode, its parameters in `dtype` (default
    float32) except the embedding and the final norm, which are float32 in any case, so that the
    calibration's hidden states are float32 from the first layer on. Widening bf16 or float16 to
    float32 is exact, so a layer widened later holds the values a float32 load gives."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype or torch.float32)
    model.eval()
    model.model.embed_tokens.float()  # a tied LM head shares the parameter, and follows it
    model.model.norm.float()
    tokenizer = AutoTokenizer.from_pretrained(src)
    return model, tokenizer


def widen_layer(layer) -> None:
    """Layer `layer` in float32 before its calibration (a no-op for a float32 load)."""
    layer.float()


def release_linears(layer, names) -> None:
    """Drop the float weights of `layer`'s linears `names` once their quantised tensors are kept:
    the loop then holds one float32 layer at a time on top of the source dtype's."""
    import torch

    from dlinfer.utils.huge_pages import release_free_memory

    for name in names:
        layer.get_submodule(name).weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    # the layer's float32 weights and its forward's temporaries sit in glibc's heaps between the
    # quantised tensors kept so far: without a trim about a float32 layer's size stayed resident per
    # layer (measured); with it the process grows by the quantised tensors only
    release_free_memory()
