"""The patches dlinfer applies to LMDeploy 0.18, one module each, applied in this order.

Each module states why it exists, how it works and the LMDeploy version it was written
against, and exposes `apply()`, which is idempotent (see `patching.wrap`). Every patch changes
behaviour for dlinfer's device types (`devices/specs.py`) only.
"""

from __future__ import annotations

from dlinfer.framework.lmdeploy_ext import patching
from dlinfer.framework.lmdeploy_ext.patches import (
    awq_linear,
    backend_selector,
    cuda_calls,
    device_queries,
    engine_config,
    env_check,
    forward_failures,
    greedy_sampling,
    huge_pages,
    image_checks,
    lm_head,
    mla_bmm,
    model_agent,
    model_dtype,
    mp_engine,
    mp_executor,
    openmp_pool,
    ray_executor,
    request_checks,
    vl_preprocess,
    weight_reads,
    window_cache,
)

PATCHES = (
    engine_config,     # PytorchEngineConfig accepts device_type="cpu"/"dlinfer_cuda", float32
    device_queries,    # get_max_batch_size / is_bf16_supported for those device types
    model_dtype,       # dtype="auto" keeps a float32 checkpoint in float32 on CPU (AWQ ones too)
    awq_linear,        # AwqLinear's scales in that dtype, not always float16
    backend_selector,  # device type -> dlinfer ops backend
    env_check,         # LMDeploy's torch check runs on the engine's device
    cuda_calls,        # streams/events/"cuda" strings in the engine modules
    model_agent,       # weights, warm-up inputs and free memory on the engine's device
    window_cache,      # models windowing only some layers (Gemma 2/3) keep their whole KV history
    mla_bmm,           # DeepSeek's per-head latent products traceable in graph mode
    weight_reads,      # safetensors shards read tensor by tensor, not mapped (CPU): no file pages on top of the weights
    lm_head,           # DLINFER_LM_HEAD: the LM head quantised to int8 (or int4) after loading
    huge_pages,        # DLINFER_HUGE_PAGES: the built model's weights moved onto 2 MB pages (CPU)
    openmp_pool,       # one OpenMP worker pool: the warm-up thread's is freed after warm-up
    mp_engine,         # the multi-process engine's child imports the adaptor, exits with its parent
    mp_executor,       # tp > 1: ranks import the adaptor, share the cores, end the engine when one dies
    ray_executor,      # LMDeploy's Ray executor on the cpu device type (applied when a Ray engine is built)
    vl_preprocess,     # VLM image preprocessors without torchvision; unsupported VLMs refused first
    image_checks,      # a request's images checked at the door (400 naming the item); serve reads no local path
    request_checks,    # token ids outside the vocabulary refused per request (400), not by the engine's death
    forward_failures,  # a forward step that raises fails the requests in flight; the engine resets and serves on
    greedy_sampling,   # greedy sampling's argmax on CPU logits as max(-1).indices (5x faster in bf16, same indices)
)


def apply_all() -> None:
    for patch in PATCHES:
        patch.apply()


def status() -> dict[str, tuple[int, int]]:
    """Patch module (short name) -> `patching.applied` for it: (attributes replaced now, attributes
    its `apply()` asked to replace); (0, 0) when its `apply()` never reached `wrap`."""
    return {patch.__name__.rpartition(".")[2]: patching.applied(patch.__name__) for patch in PATCHES}
