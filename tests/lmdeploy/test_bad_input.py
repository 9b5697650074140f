"""Bad input on device_type="cpu": a clear error or a clean rejection of one request, never a
hang or a dead engine. (An unsupported LMDeploy version: test_patching.py.)"""

from __future__ import annotations

import re
import time

import pytest
import torch
from support.engine_helpers import assert_matches_hf, cpu_pipeline, greedy_generate

from dlinfer.framework.lmdeploy_ext import UnsupportedModelError
from dlinfer.framework.lmdeploy_ext.backend.model_support import SUPPORTED_ARCHITECTURES

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name,message", [
    ("starcoder2", "cannot run architecture 'Starcoder2ForCausalLM'; supported: "
                   + ", ".join(sorted(SUPPORTED_ARCHITECTURES))),
    ("qwen2_window_layers", "cannot run Qwen2ForCausalLM with these sliding windows: LMDeploy 0.18's model windows "
                            "layers [0] as [7] where transformers uses [None]"),
    ("llama_rope_dynamic", "cannot run rope_type='dynamic' (LlamaForCausalLM): LMDeploy rescales the NTK base"),
    ("llama_rope_longrope", "cannot run rope_type='longrope' (LlamaForCausalLM): LMDeploy 0.18's dlinfer rotary "
                            "layer has no LongRoPE branch"),
])
def test_model_the_cpu_path_cannot_run_is_one_clear_error(name, message, model_dir):
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        with cpu_pipeline(model_dir(name)):
            pass
    assert time.perf_counter() - start < 60  # refused before loading weights, not after a hang


def test_dtype_the_cpu_cannot_run_is_one_clear_error(model_dir):
    with pytest.raises(ValueError, match="device_type='cpu' cannot run dtype='float16'"):
        with cpu_pipeline(model_dir("llama"), dtype="float16"):
            pass


def test_bfloat16_runs(model_dir):
    with cpu_pipeline(model_dir("llama"), dtype="bfloat16") as pipe:
        assert pipe.async_engine.engine.model_config.dtype == torch.bfloat16
        results = greedy_generate(pipe, ["The model token cache", "One two three four"], 16)
    assert all(len(r.token_ids) == 16 and r.finish_reason == "length" for r in results)


def test_requests_beyond_the_kv_cache(model_dir, hf_reference):
    """A 16-block cache of 16 tokens: the engine caps sessions at 224 tokens.

    A longer prompt is rejected alone; two requests that fit one at a time but not together
    both complete (one is preempted and recomputed), equal to HF; the engine keeps serving.
    """
    reference = hf_reference("llama")
    with cpu_pipeline(model_dir("llama"), num_gpu_blocks=16, enable_prefix_caching=True) as pipe:
        assert pipe.async_engine.engine.max_session_len == 224
        too_long = " ".join(["one two three four five six"] * 60)
        short = "The model token cache"
        results = greedy_generate(pipe, [short, too_long, short + " of the engine"], 16)
        assert len(results[1].input_ids) > 224
        assert results[1].finish_reason == "error" and results[1].token_ids == []
        assert_matches_hf([results[0], results[2]], reference, 16)

        prompts = [" ".join(["quick red river of the ocean"] * 9), " ".join(["two large green mountains"] * 12)]
        both = greedy_generate(pipe, prompts, 100)  # 2 x ~160 tokens > the 240 cache tokens
        assert sum(len(r.input_ids) + 100 for r in both) > 240
        assert_matches_hf(both, reference, 100)

        after = greedy_generate(pipe, [short], 16)
        assert_matches_hf(after, reference, 16)
