"""Architectures beyond test_pipeline_greedy.py's (Qwen3, Qwen3-MoE, Phi-3, Gemma, InternLM2): greedy
tokens through `lmdeploy.pipeline` on device_type="cpu" equal HF transformers' in float32 for a
batch of prompts of different lengths.

- eager: one engine per model, prefix caching on and `max_prefill_token_num=32`: the first pass
  prefills the short prompts without history and the longest in chunks, the second pass starts
  from cached prefix blocks; both decode the whole batch together;
- graph mode (`eager_mode=False`): decode steps run graphs compiled by dlinfer's backend, buckets 1
  and 2 (tests/lmdeploy/test_lmdeploy_graph.py checks graphs against eager, with recompile counts,
  on Llama, Qwen2 and Mixtral; it costs a minute or more per model, this a few seconds);
- bfloat16: the engine runs and produces every token (not compared with HF: bfloat16 rounding
  differs between implementations).
"""

from __future__ import annotations

import pytest
from support.engine_helpers import OpCalls, assert_matches_hf, cpu_pipeline, greedy_generate
from support.tiny_internlm2 import tiny_internlm2
from test_pipeline_greedy import PROMPTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
GRAPH_NEW_TOKENS = 10

# tiny model (tiny_models.SPECS) -> the architecture LMDeploy builds for it
MODELS = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "internlm2": "InternLM2ForCausalLM",
}
# InternLM2 is checked against HF's Llama on the same weights (tiny_internlm2.py).
REFERENCE = {"internlm2": "llama"}


@pytest.fixture(scope="session")
def checkpoint(model_dir):
    return lambda name: tiny_internlm2() if name == "internlm2" else model_dir(name)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf(name, checkpoint, hf_reference, monkeypatch):
    prefill = OpCalls(monkeypatch, "prefill_attention")
    paged_prefill = OpCalls(monkeypatch, "paged_prefill_attention")
    with cpu_pipeline(checkpoint(name), enable_prefix_caching=True, max_prefill_token_num=32) as pipe:
        assert pipe.async_engine.engine.model_config.hf_config.architectures == [MODELS[name]]
        first = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        calls_first = (prefill.count, paged_prefill.count)
        second = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert len({len(r.input_ids) for r in first}) == len(PROMPTS)
    reference = hf_reference(REFERENCE.get(name, name))
    assert_matches_hf(first, reference, NEW_TOKENS)
    assert_matches_hf(second, reference, NEW_TOKENS)
    assert calls_first[0] > 0 and calls_first[1] > 0, calls_first  # no-history and chunked prefill
    assert paged_prefill.count > calls_first[1]  # the second pass reused cached blocks


# Qwen2-MoE too: test_pipeline_greedy.py runs it eagerly only.
@pytest.mark.parametrize("name", [*MODELS, "qwen2_moe"])
def test_graph_mode_matches_hf(name, checkpoint, hf_reference):
    """eager_mode=False: decode steps run graphs compiled by dlinfer's backend, buckets 1 and 2
    (three prompts, max_batch_size=2), one compile per bucket."""
    with cpu_pipeline(checkpoint(name), eager_mode=False, max_batch_size=2) as pipe:
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        results = greedy_generate(pipe, PROMPTS, GRAPH_NEW_TOKENS)
    assert type(runner).__name__ == "DlinferGraphRunner" and runner.buckets == [1, 2]
    assert runner.graph_steps >= GRAPH_NEW_TOKENS
    assert runner.compiles == 1  # at warm-up: one trace that every bucket shares
    assert_matches_hf(results, hf_reference(REFERENCE.get(name, name)), GRAPH_NEW_TOKENS)


# Qwen2, Mixtral and Qwen2-MoE too (test_bad_input.py runs Llama in bfloat16).
@pytest.mark.parametrize("name", [*MODELS, "qwen2", "mixtral", "qwen2_moe"])
def test_bfloat16_runs(name, checkpoint):
    import torch

    with cpu_pipeline(checkpoint(name), dtype="bfloat16") as pipe:
        assert pipe.async_engine.engine.model_config.dtype == torch.bfloat16
        results = greedy_generate(pipe, PROMPTS[:2], 8)
    assert all(len(r.token_ids) == 8 and r.finish_reason == "length" for r in results)
