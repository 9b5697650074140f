"""RoPE scaling on device_type="cpu": greedy tokens equal HF transformers' for every rope type the
CPU runs, with prompts longer than the original context (where the scaling changes positions).

Each tiny Llama has one `rope_scaling`; one engine runs a batch of prompts of different lengths,
the longest past the original context (64 tokens). For each scaled type the test also checks that
the scaling matters: HF without `rope_scaling` gives other tokens for the longest prompt. Rope
types the CPU refuses, with the reason, are checked in test_bad_input.py / test_model_support.py.
"""

from __future__ import annotations

import pytest
import torch
from support.engine_helpers import assert_matches_hf, cpu_pipeline, greedy_generate

from dlinfer.framework.lmdeploy_ext.backend.model_support import SUPPORTED_ROPE_TYPES

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
ORIGINAL_CONTEXT = 64

_WORDS = ("one two three four five six seven eight nine ten hundred thousand the first expert routes the "
          "second token to the last layer while a small blue window in the dark forest opens on the ocean "
          "and the bright city mountain shows a large green head of the kernel vendor device memory").split()

PROMPTS = (
    "Quick red river",
    " ".join(_WORDS[:30]).capitalize(),
    " ".join(_WORDS + _WORDS[:40]).capitalize(),  # past the original context of 64 tokens
)

# rope type -> tiny model (tiny_models.SPECS)
MODELS = {
    "default": "llama_rope_default",
    "linear": "llama_rope_linear",
    "llama3": "llama_rope_llama3",
    "yarn": "llama_rope_yarn",
}


def test_every_supported_rope_type_is_tested():
    assert set(MODELS) == SUPPORTED_ROPE_TYPES


def _hf_without_rope_scaling(model_dir, input_ids, new_tokens, banned_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, rope_scaling=None).eval()
    assert model.config.rope_scaling is None
    with torch.inference_mode():
        out = model.generate(torch.tensor([input_ids]), do_sample=False, max_new_tokens=new_tokens,
                             bad_words_ids=[[i] for i in banned_ids] or None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(input_ids), dtype=torch.long))
    return out[0, len(input_ids):].tolist()


@pytest.mark.parametrize("rope_type", sorted(MODELS))
def test_rope_scaling_matches_hf(rope_type, model_dir, hf_reference):
    name = MODELS[rope_type]
    with cpu_pipeline(model_dir(name), enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    lengths = [len(r.input_ids) for r in results]
    assert lengths[0] < lengths[1] < ORIGINAL_CONTEXT < lengths[2], lengths
    reference = hf_reference(name)
    assert reference.model.config.rope_scaling["rope_type"] == rope_type
    assert_matches_hf(results, reference, NEW_TOKENS)
    if rope_type != "default":  # the test would not see a rope layer that ignored the scaling
        longest = results[2]
        unscaled = _hf_without_rope_scaling(model_dir(name), longest.input_ids, NEW_TOKENS, longest.banned_ids)
        assert unscaled != longest.token_ids, f"{rope_type}: scaling does not change the tokens of this prompt"


@pytest.mark.parametrize("rope_type", ["linear", "llama3", "yarn"])
def test_rope_scaling_graph_mode_matches_hf(rope_type, model_dir, hf_reference):
    """eager_mode=False: the scaled rotary layer inside decode graphs compiled by dlinfer's backend."""
    name = MODELS[rope_type]
    with cpu_pipeline(model_dir(name), eager_mode=False, max_batch_size=2) as pipe:
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert type(runner).__name__ == "DlinferGraphRunner" and runner.graph_steps >= NEW_TOKENS
    assert runner.compiles == 1  # one trace that every bucket shares
    assert_matches_hf(results, hf_reference(name), NEW_TOKENS)
