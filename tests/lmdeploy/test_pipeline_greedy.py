"""`lmdeploy.pipeline` on device_type="cpu" produces HF transformers' greedy tokens (float32).

For each tiny model (Llama, Qwen2, Mixtral, Qwen2-MoE) a batch of prompts of different lengths
runs through one engine (the default vendor, cpu; the torch vendor once per model too), under
two engine settings:
- prefix caching off, no chunking: prefill without history (`prefill_attention`) and decode;
- prefix caching on and `max_prefill_token_num=32`: the longest prompt is prefilled in chunks,
  and the batch runs twice so the second pass starts from cached prefix blocks; both reach
  `paged_prefill_attention`, which the test checks actually ran.
"""

from __future__ import annotations

import pytest
from support.engine_helpers import OpCalls, assert_matches_hf, cpu_pipeline, greedy_generate

import dlinfer.ops
import dlinfer.vendor

pytestmark = pytest.mark.slow

MODELS = ("llama", "qwen2", "mixtral", "qwen2_moe")
NEW_TOKENS = 20

PROMPTS = (
    "Quick red river",
    "The model reads a prompt token by token and the engine keeps every key and value in the cache",
    "One two three four five six seven eight nine ten hundred thousand the first expert routes the "
    "second token to the last layer while a small blue window in the dark forest opens on the ocean "
    "and the bright city mountain shows a large green head of the kernel vendor device memory",
)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf_prefix_cache_off(name, model_dir, hf_reference, monkeypatch):
    paged_prefill = OpCalls(monkeypatch, "paged_prefill_attention")
    prefill = OpCalls(monkeypatch, "prefill_attention")
    with cpu_pipeline(model_dir(name), enable_prefix_caching=False) as pipe:
        # the default vendor for device_type="cpu" (tests/vendor checks it builds wherever it can)
        assert dlinfer.vendor.vendor_name == ("cpu" if "cpu" in dlinfer.vendor.available() else "torch")
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    lengths = [len(r.input_ids) for r in results]
    assert len(set(lengths)) == len(PROMPTS) and max(lengths) > 32, lengths
    assert_matches_hf(results, hf_reference(name), NEW_TOKENS)
    assert prefill.count > 0 and paged_prefill.count == 0


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf_torch_vendor(name, model_dir, hf_reference):
    """The torch vendor (the pure-PyTorch reference every op falls back to) end to end."""
    with dlinfer.vendor.using("torch"), cpu_pipeline(model_dir(name), enable_prefix_caching=False) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(results, hf_reference(name), NEW_TOKENS)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf_prefix_cache_on_chunked_prefill(name, model_dir, hf_reference, monkeypatch):
    paged_prefill = OpCalls(monkeypatch, "paged_prefill_attention")
    with cpu_pipeline(model_dir(name), enable_prefix_caching=True, max_prefill_token_num=32) as pipe:
        first = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        chunked_calls = paged_prefill.count
        second = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        prefix_hit_calls = paged_prefill.count - chunked_calls
    reference = hf_reference(name)
    assert_matches_hf(first, reference, NEW_TOKENS)
    assert_matches_hf(second, reference, NEW_TOKENS)
    assert chunked_calls > 0, "the longest prompt was not prefilled in chunks"
    assert prefix_hit_calls > 0, "the second pass did not start from cached prefix blocks"


@pytest.mark.parametrize("vendor", [v for v in ("cpu", "torch") if v in dlinfer.vendor.available()])
def test_greedy_matches_hf_head_major_kv_cache(vendor, model_dir, hf_reference, monkeypatch):
    """The same engine with the vendor's other KV layout: caches [NB, Hkv, BS, D]."""
    paged_prefill = OpCalls(monkeypatch, "paged_prefill_attention")
    with dlinfer.vendor.using(vendor, kv_layout="head_major"):
        with cpu_pipeline(model_dir("llama"), enable_prefix_caching=True, max_prefill_token_num=32) as pipe:
            k_cache = pipe.async_engine.engine.executor.model_agent.cache_engine.gpu_cache[0][0]
            assert k_cache.shape[1:] == (2, 16, 32), k_cache.shape  # [NB, Hkv, BS, D]
            results = greedy_generate(pipe, PROMPTS, NEW_TOKENS) + greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(results, hf_reference("llama"), NEW_TOKENS)
    assert paged_prefill.count > 0


_WORDS = PROMPTS[2].lower().rstrip(".").split()


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_sixteen_concurrent_requests_all_complete(name, model_dir, hf_reference):
    prompts = [" ".join(_WORDS[i:i + 3 + 2 * i]).capitalize() for i in range(16)]
    with cpu_pipeline(model_dir(name)) as pipe:
        results = greedy_generate(pipe, prompts, 16)
    assert len({len(r.input_ids) for r in results}) > 8
    assert all(r.finish_reason == "length" and len(r.token_ids) == 16 for r in results)
    assert_matches_hf(results, hf_reference(name), 16)
