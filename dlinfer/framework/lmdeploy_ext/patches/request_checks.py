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

Messages too: a malformed `messages` list (an entry that is no object, one without a string
role, a content that is neither a string nor a list of typed parts) reached LMDeploy's chat
template and came back as the API server's vague 400 "Request preprocessing failed." (or
"'int' object is not iterable"). `AsyncEngine.__init__` marks the prompt processor of a dlinfer
device type's engine (`MARK`; `vl_preprocess` marks a VLM engine's own), and that processor's
`get_prompt_input` (called inside `preprocess`'s try) first checks the messages, raising a
ValueError naming `messages[i]`, then turns any other exception of the template step that is not
a ValueError / TypeError into one naming its type and text.
"""

from __future__ import annotations

import functools
import inspect

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap

MARK = "dlinfer_device_type"  # on a dlinfer device type's engine's prompt processor: that device type


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


def check_messages(messages) -> None:
    """Raise a ValueError naming the first entry of an OpenAI-style `messages` list that no chat
    template can take; a string prompt (or anything not a list) is left alone."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with a role and a content, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no role (a string such as 'system', 'user' or 'assistant'), "
                             f"got {role!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts, got "
                             f"{type(content).__name__}")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"messages[{i}].content[{j}] must be an object with a string type, got {part!r:.60}")


def _patch_get_prompt_input(original):

    @functools.wraps(original)
    async def get_prompt_input(self, prompt, *args, **kwargs):
        if getattr(self, MARK, None) is None:
            return await original(self, prompt, *args, **kwargs)
        from lmdeploy.serve.core.exceptions import RequestError

        check_messages(prompt)
        try:
            return await original(self, prompt, *args, **kwargs)
        except (ValueError, TypeError, RequestError):
            raise
        except Exception as exc:  # noqa: BLE001  (LMDeploy's generic "Request preprocessing failed." otherwise)
            raise ValueError(f"the messages could not be turned into a prompt with the model's chat template: "
                             f"{type(exc).__name__}: {exc}") from exc

    return get_prompt_input


def _patch_engine_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = signature.bind(self, *args, **kwargs).arguments.get("backend_config")
        spec = devices.spec_for(getattr(config, "device_type", None))
        processor = getattr(self, "prompt_processor", None)
        if spec is not None and processor is not None:
            setattr(processor, MARK, spec.device_type)

    return __init__


def apply() -> None:
    from lmdeploy.serve.core.async_engine import AsyncEngine
    from lmdeploy.serve.processors.multimodal import MultimodalProcessor

    wrap(AsyncEngine, "__init__", _patch_engine_init)
    wrap(AsyncEngine, "_determine_gen_config", _patch_determine_gen_config)
    wrap(MultimodalProcessor, "get_prompt_input", _patch_get_prompt_input)
