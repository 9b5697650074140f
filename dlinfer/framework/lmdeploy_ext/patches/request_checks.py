"""Token ids outside the model's vocabulary refused per request (written against LMDeploy 0.18.0).

Why: `AsyncEngine.preprocess` (serve/core/async_engine.py) hands a caller's `input_ids` (the
API server's /generate, `input_ids` on its chat completions, `pipeline` calls given ids) to the
engine unchecked. An id >= vocab_size, or a negative one, raises IndexError in the embedding
inside the engine's loop, which ends the engine: from then on every request gets 503 until a
restart, so one unauthenticated request takes the service down.

How: `preprocess` calls `AsyncEngine._determine_gen_config(input_ids, gen_config)` inside the
`try` whose `except (TypeError, ValueError)` turns an error into LMDeploy's own
`RequestError(ErrorCode.INVALID_REQUEST, message)`, after removing the request's session and
counting it as failed. The wrapper, for dlinfer's device types, first checks that every id is an
integer in [0, vocab_size) (vocab_size from the model's HF config, its text config for a VLM)
and raises a ValueError naming the first bad position: the API server answers 400 with that
message, a pipeline raises it, and the engine never sees the request. Ids a chat template
produced pass the same check (a tokenizer larger than the embedding is refused the same way).
"""

from __future__ import annotations

import functools

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap


def vocab_size(hf_config) -> int | None:
    """The model's embedding rows as its HF config states them (a VLM's text config), or None."""
    for config in (hf_config, getattr(hf_config, "text_config", None), getattr(hf_config, "llm_config", None)):
        value = getattr(config, "vocab_size", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def bad_token(input_ids, vocab: int) -> str | None:
    """Why `input_ids` cannot reach a model of `vocab` tokens, or None when every id fits."""
    for i, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            return (f"input_ids[{i}] = {token!r} is not a token id of this model (expected an integer in "
                    f"[0, {vocab}))")
    return None


def _patch_determine_gen_config(original):

    @functools.wraps(original)
    def _determine_gen_config(self, input_ids, *args, **kwargs):
        backend_config = getattr(self, "backend_config", None)
        if devices.spec_for(getattr(backend_config, "device_type", None)) is not None:
            vocab = vocab_size(getattr(self, "hf_cfg", None))
            problem = bad_token(input_ids, vocab) if vocab and isinstance(input_ids, (list, tuple)) else None
            if problem is not None:
                raise ValueError(problem)
        return original(self, input_ids, *args, **kwargs)

    return _determine_gen_config


def apply() -> None:
    from lmdeploy.serve.core.async_engine import AsyncEngine

    wrap(AsyncEngine, "_determine_gen_config", _patch_determine_gen_config)
