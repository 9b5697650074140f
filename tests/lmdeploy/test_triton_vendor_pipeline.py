"""LMDeploy on device_type="cpu" through the triton vendor gives the torch vendor's greedy tokens.

Every dlinfer op of the engine then runs as a Triton kernel; without a GPU that is Triton's CPU
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), so the models stay tiny. Llama covers
the dense ops, Mixtral adds the router and fused_moe kernels; prefix caching with chunked prefill
sends the second pass through paged_prefill_attention.
"""

from __future__ import annotations

import os

import pytest
from support.engine_helpers import assert_matches_hf, cpu_pipeline, greedy_generate

import dlinfer.vendor

pytestmark = [pytest.mark.slow, pytest.mark.triton]

NEW_TOKENS = 16
PROMPTS = (
    "Quick red river",
    "The model reads a prompt token by token and the engine keeps every key",
    "One two three four five six seven eight nine ten hundred thousand the first expert routes the second token",
)


def _run(model_dir, vendor_name):
    with dlinfer.vendor.using(vendor_name):
        with cpu_pipeline(model_dir, enable_prefix_caching=True, max_prefill_token_num=32, max_batch_size=4,
                          num_gpu_blocks=32) as pipe:
            assert dlinfer.vendor.vendor_name == vendor_name
            return greedy_generate(pipe, PROMPTS, NEW_TOKENS) + greedy_generate(pipe, PROMPTS, NEW_TOKENS)


@pytest.mark.skipif("triton" not in dlinfer.vendor.available(), reason="triton vendor does not load here")
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_triton_vendor_tokens_equal_torch_vendor(name, model_dir, hf_reference):
    if os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        assert torch.cuda.is_available(), "without a GPU the triton vendor needs TRITON_INTERPRET=1"
    triton_results = _run(model_dir(name), "triton")
    torch_results = _run(model_dir(name), "torch")
    assert [r.token_ids for r in triton_results] == [r.token_ids for r in torch_results]
    assert_matches_hf(triton_results, hf_reference(name), NEW_TOKENS)
