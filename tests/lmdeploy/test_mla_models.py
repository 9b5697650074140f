"""Multi-head latent attention (DeepSeek-V2 / V3) on device_type="cpu": greedy tokens through
`lmdeploy.pipeline` equal HF transformers' in float32.

LMDeploy's DeepSeek model keeps one latent KV head per token (D = kv_lora_rank + qk_rope_head_dim,
here 32 + 16) and attends with the value as a view of that cache's first kv_lora_rank dims
(`v_head_size`): fill_kv_cache writes the value into the key cache's memory, and the paged ops
read it through the strided view. Routing: V2 greedy (softmax; group-limited greedy is refused,
backend/model_support.py says why), V3's
sigmoid scores with e_score_correction_bias, group selection and routed_scaling_factor (LMDeploy's
default-backend router in PyTorch), shared experts, a dense first layer; V2 without and with a
q LoRA; V3 with YaRN (its mscale on the softmax scale) past the original context.

Eager with prefix caching and `max_prefill_token_num=32` (prefill without history, chunked,
from cached blocks; batched decode), graph mode, and bfloat16 runs.
"""

from __future__ import annotations

import pytest
from support.engine_helpers import OpCalls, assert_matches_hf, cpu_pipeline, greedy_generate
from test_pipeline_greedy import PROMPTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
GRAPH_NEW_TOKENS = 8
MODELS = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v2_q_lora": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v3_yarn": "DeepseekV3ForCausalLM",
}
LATENT, ROPE = 32, 16  # tiny_models._DEEPSEEK


def _reads_latent_values(name, args, kwargs) -> bool:
    """A paged attention call whose value cache is the key cache's first LATENT dims."""
    at = {"paged_prefill_attention": 4, "paged_decode_attention": 2}[name]  # value_cache's position
    key_cache, value_cache = args[at - 1], args[at]
    return (key_cache.shape[-1] == LATENT + ROPE and value_cache.shape[-1] == LATENT
            and value_cache.data_ptr() == key_cache.data_ptr())


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf(name, model_dir, hf_reference, monkeypatch):
    calls = OpCalls(monkeypatch, "paged_prefill_attention", "paged_decode_attention", where=_reads_latent_values)
    with cpu_pipeline(model_dir(name), enable_prefix_caching=True, max_prefill_token_num=32) as pipe:
        assert pipe.async_engine.engine.model_config.hf_config.architectures == [MODELS[name]]
        first = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        second = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    reference = hf_reference(name)
    assert_matches_hf(first, reference, NEW_TOKENS)
    assert_matches_hf(second, reference, NEW_TOKENS)
    assert calls.count > 0


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_graph_mode_matches_hf(name, model_dir, hf_reference):
    with cpu_pipeline(model_dir(name), eager_mode=False, max_batch_size=2) as pipe:
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        results = greedy_generate(pipe, PROMPTS, GRAPH_NEW_TOKENS)
    assert type(runner).__name__ == "DlinferGraphRunner" and runner.graph_steps >= GRAPH_NEW_TOKENS
    assert_matches_hf(results, hf_reference(name), GRAPH_NEW_TOKENS)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_bfloat16_runs(name, model_dir):
    import torch

    with cpu_pipeline(model_dir(name), dtype="bfloat16") as pipe:
        assert pipe.async_engine.engine.model_config.dtype == torch.bfloat16
        results = greedy_generate(pipe, PROMPTS, 8)
    assert all(len(r.token_ids) == 8 for r in results)
