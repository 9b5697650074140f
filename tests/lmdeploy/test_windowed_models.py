"""Sliding-window and soft-capped models (backend/scored_attention.py): greedy tokens through
`lmdeploy.pipeline` on device_type="cpu" equal HF transformers' in float32, with prompts longer
than the window (7 keys) and one longer than several KV blocks, so that decode skips whole blocks.

- Mistral, Phi-3 and Qwen2 (use_sliding_window, max_window_layers=0) window every layer;
- Gemma 2 windows every other layer and soft-caps attention scores and logits;
- Gemma 3's text model windows five layers of six (and runs a local rope on them).

Eager: prefix caching on and `max_prefill_token_num=32`, two passes, so the windows run in
prefill without history, chunked paged prefill, prefill from cached blocks and batched decode.
Graph mode: decode steps compiled by dlinfer's backend.
"""

from __future__ import annotations

import pytest
from support.engine_helpers import OpCalls, assert_matches_hf, cpu_pipeline, greedy_generate
from test_pipeline_greedy import PROMPTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
GRAPH_NEW_TOKENS = 10
# tiny model (tiny_models.SPECS) -> the architecture LMDeploy builds for it
MODELS = {
    "mistral": "MistralForCausalLM",
    "phi3_window": "Phi3ForCausalLM",
    "qwen2_sliding_window": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
WINDOW = 7
# Over 64 tokens: with 16-token blocks, its decode steps skip whole blocks before the window.
LONG_PROMPT = " ".join([PROMPTS[2]] * 2)
# A prompt shorter than the window, then longer ones.
WINDOW_PROMPTS = ("Seven small blue windows", *PROMPTS[1:], LONG_PROMPT)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf(name, model_dir, hf_reference, monkeypatch):
    attention = ("prefill_attention", "paged_prefill_attention", "paged_decode_attention")
    windowed = OpCalls(monkeypatch, *attention, where=lambda _, args, kwargs: kwargs.get("sliding_window") == WINDOW)
    capped = OpCalls(monkeypatch, *attention, where=lambda _, args, kwargs: bool(kwargs.get("logit_softcapping")))
    with cpu_pipeline(model_dir(name), enable_prefix_caching=True, max_prefill_token_num=32) as pipe:
        assert pipe.async_engine.engine.model_config.hf_config.architectures == [MODELS[name]]
        first = greedy_generate(pipe, WINDOW_PROMPTS, NEW_TOKENS)
        second = greedy_generate(pipe, WINDOW_PROMPTS, NEW_TOKENS)
    lengths = [len(r.input_ids) for r in first]
    assert min(lengths[1:]) > WINDOW and max(lengths) > 64, lengths
    reference = hf_reference(name)
    assert_matches_hf(first, reference, NEW_TOKENS)
    assert_matches_hf(second, reference, NEW_TOKENS)
    assert windowed.count > 0
    assert (capped.count > 0) == (name == "gemma2")


@pytest.mark.parametrize("name", MODELS)
def test_graph_mode_matches_hf(name, model_dir, hf_reference):
    with cpu_pipeline(model_dir(name), eager_mode=False, max_batch_size=2) as pipe:
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        results = greedy_generate(pipe, WINDOW_PROMPTS, GRAPH_NEW_TOKENS)
    assert type(runner).__name__ == "DlinferGraphRunner" and runner.graph_steps >= GRAPH_NEW_TOKENS
    assert_matches_hf(results, hf_reference(name), GRAPH_NEW_TOKENS)


def test_the_window_changes_the_answer(model_dir, hf_reference):
    """The tests above can fail: the same Mistral weights without a window answer otherwise on the
    long prompt (so a layer that dropped the window would not pass as HF's)."""
    from support.engine_helpers import HFReference

    with cpu_pipeline(model_dir("mistral")) as pipe:
        windowed = greedy_generate(pipe, (LONG_PROMPT,), NEW_TOKENS)[0]
    assert_matches_hf([windowed], hf_reference("mistral"), NEW_TOKENS)
    unwindowed = HFReference(model_dir("mistral"))  # its own copy: the session's keeps its window
    unwindowed.model.config.sliding_window = None
    tokens, _ = unwindowed.greedy(windowed.input_ids, NEW_TOKENS, windowed.banned_ids)
    assert tokens != windowed.token_ids


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_runs(name, model_dir):
    import torch

    with cpu_pipeline(model_dir(name), dtype="bfloat16") as pipe:
        assert pipe.async_engine.engine.model_config.dtype == torch.bfloat16
        results = greedy_generate(pipe, WINDOW_PROMPTS, 8)
    assert all(len(r.token_ids) == 8 for r in results)
