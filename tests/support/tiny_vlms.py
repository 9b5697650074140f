"""Tiny random-weight vision-language checkpoints built offline for the LMDeploy tests.

Each is a HF folder LMDeploy and HF transformers both load offline: config.json from
transformers' own config classes (a vision config and a text config, small sizes),
model.safetensors with seeded random weights in float32, a byte-level BPE tokenizer (the one
`tiny_models.py` trains, plus the model's image tokens and a chat template), the slow (PIL +
numpy) image processor of the model, and processor_config.json. No video processor is saved:
transformers' video processors need torchvision (see docs/lmdeploy.md, "Vision-language models").

Folders are cached as `tiny_models.py` caches its own (`$DLINFER_TEST_CACHE/tiny_models`), keyed
by a hash of everything that defines them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from support.tiny_models import CACHE_ROOT, COMMON, SEED, VOCAB_SIZE, _corpus, cached_folder

# A ChatML template (Qwen2-VL's and InternVL3's): both sides render the same prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% elif item['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]

# The image tokens of each model and the tokenizer attributes its HF processor reads.
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
QWEN2_VL_TOKENS = {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
                   "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}

_TEXT = dict(COMMON, intermediate_size=256)


def _qwen_vl_text(model_type: str) -> dict:
    """The language model of the tiny Qwen2-VL and Qwen2.5-VL: M-RoPE, tied to the embeddings."""
    return dict(model_type=model_type, use_sliding_window=False,
                rope_scaling=dict(type="mrope", mrope_section=[4, 6, 6]), **dict(_TEXT, tie_word_embeddings=True))


# Their image processor: 14-pixel patches merged 2x2, at most 64 merged tokens an image.
_QWEN_VL_IMAGES = dict(image_processor_type="Qwen2VLImageProcessor", patch_size=14, temporal_patch_size=2,
                       merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 64)

# Bump when the builder below changes what it writes (the cache key covers SPECS, not the code).
BUILDER_VERSION = 1

def _internvl(text_config: dict) -> dict:
    """An HF-native InternVL spec with the language model `text_config`."""
    return dict(
        model="InternVLForConditionalGeneration",
        config=dict(
            model_type="internvl",
            vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               image_size=[56, 56], patch_size=[7, 7], initializer_range=0.2,
                               layer_scale_init_value=1.0),
            text_config=text_config,
            image_seq_length=16, downsample_ratio=0.5, projector_hidden_act="gelu",
            vision_feature_layer=-1, vision_feature_select_strategy="default"),
        image_processor=dict(image_processor_type="GotOcr2ImageProcessor", size={"height": 56, "width": 56},
                             crop_to_patches=True, min_patches=1, max_patches=6),
        processor=dict(processor_class="InternVLProcessor", image_seq_length=16),
        tokens=INTERNVL_TOKENS)


# name -> what defines the checkpoint: the HF model class, its config, the image processor and
# processor config, and the special tokens.
SPECS: dict[str, dict] = {
    # InternVL3-style (HF-native): an InternViT with 56x56 tiles of 7x7 patches (64 patches, 16
    # tokens after the 0.5 pixel shuffle), a Qwen2 language model.
    "internvl": _internvl(dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                               **_TEXT)),
    # The same with a Llama language model: the HF-native reference of the remote-code InternVL with
    # an InternLM2 one (tiny_internvl_chat("internlm2"): InternLM2 is Llama in other names).
    "internvl_llama": _internvl(dict(model_type="llama", architectures=["LlamaForCausalLM"], **_TEXT)),
    # Qwen2-VL: 14x14 patches, 2x2 merge, mrope (sections of a 32-dim head: 4 + 6 + 6), the LM head
    # tied to the embeddings (as Qwen2-VL-2B).
    "qwen2_vl": dict(
        model="Qwen2VLForConditionalGeneration",
        config=dict(
            model_type="qwen2_vl",
            vision_config=dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=2, hidden_size=_TEXT["hidden_size"],
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2),
            text_config=_qwen_vl_text("qwen2_vl_text"),
            tie_word_embeddings=True),
        image_processor=dict(_QWEN_VL_IMAGES),
        processor=dict(processor_class="Qwen2VLProcessor"),
        tokens=QWEN2_VL_TOKENS),
    # Qwen2.5-VL: as Qwen2-VL, with RMSNorm/SwiGLU vision blocks and window attention (56-pixel
    # windows: 2x2 merged tokens) in all blocks but the full-attention ones (1 and 3).
    "qwen2_5_vl": dict(
        model="Qwen2_5_VLForConditionalGeneration",
        config=dict(
            model_type="qwen2_5_vl",
            vision_config=dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=4,
                               out_hidden_size=_TEXT["hidden_size"], patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3],
                               initializer_range=0.2),
            text_config=_qwen_vl_text("qwen2_5_vl_text"),
            tie_word_embeddings=True),
        image_processor=dict(_QWEN_VL_IMAGES),
        processor=dict(processor_class="Qwen2_5_VLProcessor"),
        tokens=QWEN2_VL_TOKENS),
}


def _key(spec: dict) -> str:
    blob = json.dumps({"spec": spec, "seed": SEED, "vocab": VOCAB_SIZE, "corpus": _corpus()[:50],
                       "chat": CHAT_TEMPLATE, "builder": BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _save_tokenizer(folder: Path, tokens: dict[str, str]) -> dict[str, int]:
    """The tiny BPE tokenizer with `tokens` as special tokens; returns their ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", *CHAT_TOKENS, *tokens.values()]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.token_to_id("<s>") == 1 and tok.get_vocab_size() <= VOCAB_SIZE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens=dict(tokens))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return {name: tok.token_to_id(text) for name, text in tokens.items()}


def _save_model(spec: dict, ids: dict[str, int], folder: Path) -> None:
    import torch
    import transformers

    config = copy.deepcopy(spec["config"])  # transformers edits nested dicts (rope_scaling) in place
    model_type = config.pop("model_type")
    if model_type == "internvl":
        config["image_token_id"] = ids["context_image_token"]
    else:
        config.update(image_token_id=ids["image_token"], video_token_id=ids["video_token"],
                      vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    hf_config.architectures = [spec["model"]]
    hf_config.text_config.bos_token_id = COMMON["bos_token_id"]
    torch.manual_seed(SEED)
    model = getattr(transformers, spec["model"])(hf_config).to(torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    # transformers 4.57 writes Qwen2-VL's `architectures` into text_config only; published
    # checkpoints (and LMDeploy's `get_model_arch`) have it at the top level.
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    saved["architectures"] = [spec["model"]]
    path.write_text(json.dumps(saved, indent=2, sort_keys=True))


def _save_processor(spec: dict, folder: Path) -> None:
    (folder / "preprocessor_config.json").write_text(
        json.dumps({**spec["image_processor"], "processor_class": spec["processor"]["processor_class"]}, indent=2))
    (folder / "processor_config.json").write_text(json.dumps(spec["processor"], indent=2))


def tiny_vlm(name: str) -> Path:
    """The folder of tiny VLM `name` (a key of SPECS), built on first use."""
    spec = SPECS[name]

    def build(staging: Path) -> None:
        ids = _save_tokenizer(staging, spec["tokens"])
        _save_model(spec, ids, staging)
        _save_processor(spec, staging)

    return cached_folder(CACHE_ROOT / "tiny_models" / f"{name}-{_key(spec)}", build)


# ---------------------------------------------------------------- remote-code InternVL

# The checkpoint's own config module (InternVL 1.5/2 checkpoints ship one, `auto_map` points at
# it). Written here for the tests: the config classes LMDeploy reads, nothing else.
INTERNVL_CHAT_CONFIG_MODULE = '''"""InternVLChatConfig for dlinfer's tiny remote-code InternVL test checkpoint."""
from transformers import AutoConfig, PretrainedConfig


class InternVisionConfig(PretrainedConfig):
    model_type = "intern_vit_6b"


class InternLM2Config(PretrainedConfig):
    model_type = "internlm2"


class InternVLChatConfig(PretrainedConfig):
    model_type = "internvl_chat"
    is_composition = True

    def __init__(self, vision_config=None, llm_config=None, **kwargs):
        super().__init__(**kwargs)
        self.vision_config = InternVisionConfig(**(vision_config or {}))
        llm = dict(llm_config or {"model_type": "qwen2"})
        model_type = llm.pop("model_type")
        if model_type == "internlm2":  # no transformers class: its own config, as its checkpoints carry
            self.llm_config = InternLM2Config(**llm)
        else:
            self.llm_config = AutoConfig.for_model(model_type, **llm)

    def to_dict(self):
        out = super().to_dict()
        out["vision_config"] = self.vision_config.to_dict()
        out["llm_config"] = self.llm_config.to_dict()
        return out
'''


def internvl_chat_weights(hf_weights: dict) -> dict:
    """The weights of an HF-native InternVL (`InternVLForConditionalGeneration`, as transformers
    4.57 saves them) under the remote-code `InternVLChatModel`'s names: the vision tower's q/k/v
    fused into one `qkv`, its layer scales `ls1`/`ls2`, the projector as `mlp1.{0,1,3}` (the
    language model's `language_model.*` names are the remote ones already)."""
    out, renames = {}, (
        ("vision_tower.embeddings.cls_token", "vision_model.embeddings.class_embedding"),
        ("vision_tower.embeddings.patch_embeddings.projection", "vision_model.embeddings.patch_embedding"),
        ("vision_tower.embeddings.position_embeddings", "vision_model.embeddings.position_embedding"),
        ("vision_tower.encoder.layer.", "vision_model.encoder.layers."),
        (".attention.projection_layer.", ".attn.proj."), (".lambda_1", ".ls1"), (".lambda_2", ".ls2"),
        (".layernorm_before.", ".norm1."), (".layernorm_after.", ".norm2."),
        ("multi_modal_projector.layer_norm.", "mlp1.0."), ("multi_modal_projector.linear_1.", "mlp1.1."),
        ("multi_modal_projector.linear_2.", "mlp1.3."))
    for name, tensor in hf_weights.items():
        if ".attention.k_proj." in name or ".attention.v_proj." in name:
            continue
        if ".attention.q_proj." in name:
            parts = [hf_weights[name.replace(".q_proj.", f".{p}_proj.")] for p in "qkv"]
            tensor, name = _cat(parts), name.replace(".attention.q_proj.", ".attn.qkv.")
        for old, new in renames:
            name = name.replace(old, new)
        out[name] = tensor
    return out


def _cat(parts):
    import torch

    return torch.cat(parts, dim=0)


def tiny_internvl_chat(llm: str = "qwen2") -> Path:
    """A remote-code InternVL (InternVLChatModel: InternViT + a Qwen2 or InternLM2 language model)
    with the weights of a tiny HF-native one (`tiny_vlm("internvl")`, or "internvl_llama" for
    InternLM2, whose weights are the Llama's in InternLM2's layout), so that the HF-native model is
    its reference."""
    import shutil

    from safetensors.torch import load_file, save_file

    from support.tiny_internlm2 import internlm2_config, internlm2_state_dict

    source = tiny_vlm({"qwen2": "internvl", "internlm2": "internvl_llama"}[llm])
    hf = json.loads((source / "config.json").read_text())
    vision, text = hf["vision_config"], hf["text_config"]

    def build(staging: Path) -> None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (source / name).exists():
                shutil.copy(source / name, staging / name)
        weights = internvl_chat_weights(load_file(source / "model.safetensors"))
        llm_config = {**text, "architectures": ["Qwen2ForCausalLM"]}
        if llm == "internlm2":
            lm = {name[len("language_model."):]: t for name, t in weights.items() if name.startswith("language_model.")}
            lm = internlm2_state_dict(lm, text["num_attention_heads"], text["num_key_value_heads"])
            weights = {**{n: t for n, t in weights.items() if not n.startswith("language_model.")},
                       **{f"language_model.{n}": t for n, t in lm.items()}}
            llm_config = internlm2_config(text)
        save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "configuration_internvl_chat.py").write_text(INTERNVL_CHAT_CONFIG_MODULE)
        config = {
            "architectures": ["InternVLChatModel"], "model_type": "internvl_chat",
            "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig"},
            "vision_config": {
                "architectures": ["InternVisionModel"], "hidden_size": vision["hidden_size"],
                "num_hidden_layers": vision["num_hidden_layers"], "num_attention_heads": vision["num_attention_heads"],
                "intermediate_size": vision["intermediate_size"], "image_size": vision["image_size"][0],
                "patch_size": vision["patch_size"][0], "qkv_bias": vision["attention_bias"],
                "qk_normalization": vision["use_qk_norm"], "norm_type": vision["norm_type"],
                "layer_norm_eps": vision["layer_norm_eps"], "hidden_act": vision["hidden_act"],
                "torch_dtype": "float32"},
            "llm_config": llm_config,
            "downsample_ratio": hf["downsample_ratio"], "force_image_size": vision["image_size"][0],
            "select_layer": hf["vision_feature_layer"], "ps_version": "v2", "template": "internvl2_5",
            "dynamic_image_size": True, "use_thumbnail": True, "min_dynamic_patch": 1, "max_dynamic_patch": 6,
            "torch_dtype": "float32", "tie_word_embeddings": False,
        }
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    key = hashlib.sha256((INTERNVL_CHAT_CONFIG_MODULE + source.name + llm + "v2").encode()).hexdigest()[:12]
    return cached_folder(CACHE_ROOT / "tiny_models" / f"internvl_chat_{llm}-{key}", build)
