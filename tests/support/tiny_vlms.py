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

# name -> what defines the checkpoint: the HF model class, its config, the image processor and
# processor config, and the special tokens.
SPECS: dict[str, dict] = {
    # InternVL3-style (HF-native): an InternViT with 56x56 tiles of 7x7 patches (64 patches, 16
    # tokens after the 0.5 pixel shuffle), a Qwen2 language model.
    "internvl": dict(
        model="InternVLForConditionalGeneration",
        config=dict(
            model_type="internvl",
            vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               image_size=[56, 56], patch_size=[7, 7], initializer_range=0.2,
                               layer_scale_init_value=1.0),
            text_config=dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                             **_TEXT),
            image_seq_length=16, downsample_ratio=0.5, projector_hidden_act="gelu",
            vision_feature_layer=-1, vision_feature_select_strategy="default"),
        image_processor=dict(image_processor_type="GotOcr2ImageProcessor", size={"height": 56, "width": 56},
                             crop_to_patches=True, min_patches=1, max_patches=6),
        processor=dict(processor_class="InternVLProcessor", image_seq_length=16),
        tokens=INTERNVL_TOKENS),
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
