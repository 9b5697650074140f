"""A tiny InternLM2 checkpoint written from the tiny Llama one: same weights, InternLM2's layout.

transformers has no InternLM2 classes (real checkpoints ship their own `modeling_internlm2.py`
and `configuration_internlm2.py`, run with trust_remote_code), so the test compares LMDeploy's
InternLM2 on this checkpoint with HF's Llama on the Llama one: the two models compute the same
function (InternLM2 is Llama with fused, head-grouped QKV and other names).

What changes, per LMDeploy 0.18's models/internlm2.py:
- names: model.embed_tokens -> model.tok_embeddings, self_attn.o_proj -> attention.wo,
  mlp.{gate,up,down}_proj -> feed_forward.{w1,w3,w2}, input_layernorm -> attention_norm,
  post_attention_layernorm -> ffn_norm, lm_head -> output;
- q/k/v_proj -> one attention.wqkv, grouped per KV head: [Hkv, G + 2, D, hidden] flattened (the
  G query heads that share KV head h, then h's key, then h's value; G = H / Hkv), which LMDeploy
  splits with `weight_spliter(layout="hgd")`;
- config.json: model_type "internlm2", InternLM2's field names (`bias`, no `attention_bias`) and
  the `auto_map` real checkpoints carry. Without trust_remote_code (LMDeploy's default), LMDeploy
  reads it as a generic `PretrainedConfig` (hf_configs.config_from_pretrained's fallback), which
  is what this test runs, so no remote code is needed offline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.tiny_models import CACHE_ROOT, cached_folder, tiny_model

SOURCE = "llama"
_FORMAT = 1  # bump when the conversion changes (the cached folder's name includes it)


def internlm2_state_dict(llama_state: dict, num_heads: int, num_kv_heads: int) -> dict:
    """InternLM2 tensors (names, fused grouped wqkv) from a Llama state dict."""
    import torch

    out = {}
    group = num_heads // num_kv_heads
    for name, tensor in llama_state.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            continue
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name[: -len("self_attn.q_proj.weight")]
            q = tensor
            k = llama_state[prefix + "self_attn.k_proj.weight"]
            v = llama_state[prefix + "self_attn.v_proj.weight"]
            hidden = q.shape[1]
            head_dim = q.shape[0] // num_heads
            wqkv = [q.view(num_kv_heads, group, head_dim, hidden), k.view(num_kv_heads, 1, head_dim, hidden),
                    v.view(num_kv_heads, 1, head_dim, hidden)]
            out[prefix + "attention.wqkv.weight"] = torch.cat(wqkv, dim=1).reshape(-1, hidden).contiguous()
            continue
        new = (name.replace("model.embed_tokens.", "model.tok_embeddings.")
               .replace("self_attn.o_proj.", "attention.wo.")
               .replace("mlp.gate_proj.", "feed_forward.w1.")
               .replace("mlp.up_proj.", "feed_forward.w3.")
               .replace("mlp.down_proj.", "feed_forward.w2.")
               .replace("input_layernorm.", "attention_norm.")
               .replace("post_attention_layernorm.", "ffn_norm."))
        if new == "lm_head.weight":
            new = "output.weight"
        out[new] = tensor.contiguous()
    return out


def internlm2_config(llama_config: dict) -> dict:
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
            "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_theta", "rope_scaling")
    config = {key: llama_config.get(key) for key in keep}
    config.update(
        architectures=["InternLM2ForCausalLM"],
        model_type="internlm2",
        auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config",
                  "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
        bias=False,
        attn_implementation="eager",
        torch_dtype="float32",
        use_cache=True,
    )
    return config


def tiny_internlm2() -> Path:
    """The folder of the tiny InternLM2 checkpoint (built on first use from tiny_model("llama"))."""
    from safetensors.torch import load_file, save_file

    source = tiny_model(SOURCE)

    def build(staging: Path) -> None:
        llama_config = json.loads((source / "config.json").read_text())
        state = load_file(source / "model.safetensors")
        tensors = internlm2_state_dict(state, llama_config["num_attention_heads"], llama_config["num_key_value_heads"])
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(internlm2_config(llama_config), indent=2))
        for item in source.iterdir():  # tokenizer and generation config
            if item.name not in ("config.json", "model.safetensors"):
                shutil.copy(item, staging / item.name)

    return cached_folder(CACHE_ROOT / "tiny_models" / f"internlm2-from-{source.name}-v{_FORMAT}", build)
