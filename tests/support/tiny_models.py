"""Tiny random-weight HF checkpoints built offline for the LMDeploy tests.

Each model is a plain HF folder (config.json, model.safetensors, tokenizer files) in float32,
built from a transformers config with seeded random weights and a byte-level BPE tokenizer
trained here with `tokenizers`. Folders are cached under `$DLINFER_TEST_CACHE` (default
`<repo>/.cache/tests`) keyed by a hash of everything that defines them, so a session builds
each one once and later sessions reuse it.

Weights use initializer_range=0.2 (HF's default is 0.02): larger logits make greedy decoding
depend on the whole context instead of collapsing into one repeated token, which makes token
equality with HF a sharper test, and widen the gap between the top two logits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = Path(os.environ.get("DLINFER_TEST_CACHE", REPO_ROOT / ".cache" / "tests"))

VOCAB_SIZE = 512
SEED = 1234

_WORDS = (
    "the a an of to in on for with from by at as is are was were be been this that these those "
    "model token cache block head layer norm rotary attention expert router weight value key query "
    "prefill decode batch sequence prompt answer question engine vendor kernel device memory "
    "red green blue small large quick slow bright dark river mountain city forest ocean window "
    "one two three four five six seven eight nine ten hundred thousand first second last next"
).split()


def _corpus() -> list[str]:
    """A deterministic English-like corpus (no randomness from the environment)."""
    lines, n = [], len(_WORDS)
    for i in range(2000):
        words = [_WORDS[(i * 7 + j * j * 13 + j * 5) % n] for j in range(6 + i % 11)]
        lines.append(" ".join(words).capitalize() + ".")
    return lines


COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=None,  # no EOS: HF generate and LMDeploy (ignore_eos) both produce every token
    pad_token_id=0,
)


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


_DEEPSEEK = dict(intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                 num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, n_group=2, topk_group=1)

SPECS: dict[str, dict] = {
    "llama": dict(model_type="llama", intermediate_size=256, **COMMON),
    "qwen2": dict(model_type="qwen2", intermediate_size=256, use_sliding_window=False, **COMMON),
    # The LM head tied to the embeddings, as SmolLM2's (tests/lmdeploy/test_int8_lm_head.py).
    "llama_tied": dict(model_type="llama", intermediate_size=256, **_with(COMMON, tie_word_embeddings=True)),
    "mixtral": dict(model_type="mixtral", intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None, **COMMON),
    "qwen2_moe": dict(model_type="qwen2_moe", intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                      num_experts_per_tok=2, shared_expert_intermediate_size=96, decoder_sparse_step=1,
                      norm_topk_prob=False, mlp_only_layers=[], use_sliding_window=False, **COMMON),
    # More architectures (tests/lmdeploy/test_architectures.py), as their real checkpoints are:
    # small Qwen3 and every Gemma tie the LM head to the embeddings; Qwen3-MoE normalises top-k.
    "qwen3": dict(model_type="qwen3", intermediate_size=256, head_dim=32, use_sliding_window=False,
                  **_with(COMMON, tie_word_embeddings=True)),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      head_dim=32, use_sliding_window=False, **COMMON),
    "phi3": dict(model_type="phi3", intermediate_size=256, sliding_window=None, **COMMON),
    "gemma": dict(model_type="gemma", intermediate_size=256, head_dim=32, hidden_act="gelu_pytorch_tanh",
                  **_with(COMMON, tie_word_embeddings=True)),
    # RoPE scaling (tests/lmdeploy/test_rope_scaling.py): prompts longer than the original context.
    "llama_rope_llama3": dict(model_type="llama", intermediate_size=256, **COMMON,
                              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=64)),
    "llama_rope_default": dict(model_type="llama", intermediate_size=256, **COMMON,
                               rope_scaling=dict(rope_type="default")),
    "llama_rope_linear": dict(model_type="llama", intermediate_size=256, **COMMON,
                              rope_scaling=dict(rope_type="linear", factor=2.5)),
    "llama_rope_yarn": dict(model_type="llama", intermediate_size=256, **_with(
        COMMON, max_position_embeddings=256,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    # Architectures / features the CPU device type must refuse (tests/lmdeploy/test_bad_input.py).
    "llama_rope_longrope": dict(model_type="llama", intermediate_size=256, **_with(
        COMMON, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 16, long_factor=[4.0] * 16))),
    "llama_rope_dynamic": dict(model_type="llama", intermediate_size=256, **_with(
        COMMON, max_position_embeddings=64, rope_scaling=dict(rope_type="dynamic", factor=4.0))),
    # Qwen2 windowing only some layers (max_window_layers > 0), which LMDeploy windows all of.
    "qwen2_window_layers": dict(model_type="qwen2", intermediate_size=256, use_sliding_window=True,
                                sliding_window=7, max_window_layers=1, **COMMON),
    # An architecture dlinfer does not run (LMDeploy knows it).
    "starcoder2": dict(model_type="starcoder2", intermediate_size=256, sliding_window=None, **COMMON),
    # Sliding windows (7 keys, shorter than most test prompts) and soft-capping
    # (tests/lmdeploy/test_windowed_models.py). Caps far below the real 50 / 30, so that they bend
    # these small random models' scores.
    "mistral": dict(model_type="mistral", intermediate_size=256, sliding_window=7, **COMMON),
    "phi3_window": dict(model_type="phi3", intermediate_size=256, sliding_window=7, **COMMON),
    "qwen2_sliding_window": dict(model_type="qwen2", intermediate_size=256, use_sliding_window=True,
                                 sliding_window=7, max_window_layers=0, **COMMON),
    "gemma2": dict(model_type="gemma2", intermediate_size=256, head_dim=32, query_pre_attn_scalar=32,
                   sliding_window=7, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                   hidden_activation="gelu_pytorch_tanh", post_norm_weight=8.0,
                   **_with(COMMON, tie_word_embeddings=True)),
    # MLA (DeepSeek-V2/V3, tests/lmdeploy/test_mla_models.py): one latent KV head of 32 + 16 rope dims,
    # a dense first layer, then MoE layers of 4 routed experts (2 per token) and a shared one. The
    # keys LMDeploy reads that transformers' own configs lack (DeepSeek's checkpoints carry them).
    "deepseek_v2": dict(model_type="deepseek_v2", **_DEEPSEEK, q_lora_rank=None, topk_method="greedy",
                        scoring_func="softmax", **_with(COMMON, num_key_value_heads=4)),
    "deepseek_v2_q_lora": dict(model_type="deepseek_v2", **_DEEPSEEK, q_lora_rank=48, topk_method="greedy",
                               scoring_func="softmax",
                               **_with(COMMON, num_key_value_heads=4)),
    "deepseek_v3": dict(model_type="deepseek_v3", **_DEEPSEEK, q_lora_rank=48, topk_method="noaux_tc",
                        scoring_func="sigmoid", routed_scaling_factor=2.5, score_bias_std=0.1,
                        **_with(COMMON, num_key_value_heads=4, norm_topk_prob=True)),
    # DeepSeek-V3 with YaRN (as its checkpoints): prompts past a 32-token original context.
    "deepseek_v3_yarn": dict(model_type="deepseek_v3", **_DEEPSEEK, q_lora_rank=48, topk_method="noaux_tc",
                             scoring_func="sigmoid", routed_scaling_factor=2.5, score_bias_std=0.1,
                             **_with(COMMON, num_key_value_heads=4, norm_topk_prob=True, rope_scaling=dict(
                                 rope_type="yarn", type="yarn", factor=4.0, original_max_position_embeddings=32,
                                 mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1))),
    # Gemma 3's text model: five windowed layers, then a global one. Both Gemmas with their post-attention
    # and post-MLP norm weights at 8 (x9 in Gemma's 1 + w): from the zero init, the sqrt(hidden)-scaled
    # embeddings outweigh every layer and the model only repeats its last input token.
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=256, head_dim=32, query_pre_attn_scalar=32,
                        sliding_window=7, hidden_activation="gelu_pytorch_tanh", rope_local_base_freq=10000.0,
                        post_norm_weight=8.0, **_with(COMMON, tie_word_embeddings=True, num_hidden_layers=6)),
}


def _key(spec: dict) -> str:
    blob = json.dumps({"spec": spec, "seed": SEED, "vocab": VOCAB_SIZE, "corpus": _corpus()[:50]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.token_to_id("<s>") == 1 and tok.get_vocab_size() <= VOCAB_SIZE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(folder)


def _save_model(spec: dict, folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    post_norm = spec.pop("post_norm_weight", None)
    score_bias = spec.pop("score_bias_std", None)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if post_norm is not None:  # Gemma 2/3's norms after attention and MLP, from their zero init
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "post_attention_layernorm" in name or "post_feedforward_layernorm" in name:
                    param.fill_(post_norm)
    if score_bias is not None:  # DeepSeek-V3's router bias, zero at init: random, so that it steers routing
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "e_score_correction_bias" in name:
                    param.copy_(torch.randn(param.shape) * score_bias)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)


def cached_folder(folder: Path, build) -> Path:
    """`folder`, built on first use by `build(staging)` into a temporary sibling folder that is
    renamed into place at the end, so a folder that exists is always complete (and two processes
    building it at once leave one complete copy)."""
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build(staging)
        os.replace(staging, folder)
    except OSError:
        if not (folder / "config.json").exists():  # a concurrent builder did not win the race either
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def tiny_model(name: str) -> Path:
    """The folder of tiny model `name` (a key of SPECS), built on first use."""
    spec = SPECS[name]

    def build(staging: Path) -> None:
        _save_tokenizer(staging)
        _save_model(spec, staging)

    return cached_folder(CACHE_ROOT / "tiny_models" / f"{name}-{_key(spec)}", build)
