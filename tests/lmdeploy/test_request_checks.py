"""patches/request_checks.py: the id check itself, and where it sits in LMDeploy's preprocess (the
server-level test is in tests/lmdeploy/test_serve.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dlinfer.framework.lmdeploy_ext.patches import request_checks


def test_every_id_must_be_an_integer_inside_the_vocabulary():
    assert request_checks.bad_token([0, 5, 9], 10) is None
    assert request_checks.bad_token([], 10) is None
    for ids, message in (([1, 10], "input_ids[1] = 10 is"), ([-1], "input_ids[0] = -1 is"),
                         ([1, 2.0], "input_ids[1] = 2.0 is"), ([True], "input_ids[0] = True is"),
                         ([3, "7"], "input_ids[1] = '7' is")):
        assert request_checks.bad_token(ids, 10).startswith(message), ids
    assert "expected an integer in [0, 10)" in request_checks.bad_token([11], 10)


def test_the_vocabulary_comes_from_the_text_config_of_a_vlm():
    assert request_checks.vocab_size(SimpleNamespace(vocab_size=512)) == 512
    assert request_checks.vocab_size(SimpleNamespace(text_config=SimpleNamespace(vocab_size=300))) == 300
    assert request_checks.vocab_size(SimpleNamespace(llm_config=SimpleNamespace(vocab_size=7))) == 7
    assert request_checks.vocab_size(None) is None


def test_preprocess_turns_a_bad_id_into_an_invalid_request():
    """The real AsyncEngine.preprocess, on a stand-in engine object: LMDeploy's own except clause
    makes the ValueError an INVALID_REQUEST (HTTP 400) and removes the session."""
    from lmdeploy.serve.core.async_engine import AsyncEngine
    from lmdeploy.serve.core.exceptions import ErrorCode, RequestError

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    removed = []
    session = SimpleNamespace(session_id=1, _handle=None)

    def engine(device_type):
        return SimpleNamespace(backend_config=SimpleNamespace(device_type=device_type, enable_prefix_caching=False),
                               hf_cfg=SimpleNamespace(vocab_size=64), session_len=1024,
                               session_mgr=SimpleNamespace(get=lambda session_id: session,
                                                           remove=removed.append),
                               _determine_gen_config=lambda ids, gen_config=None: AsyncEngine._determine_gen_config(
                                   engine_obj, ids, gen_config=gen_config))

    engine_obj = engine("cpu")
    with pytest.raises(RequestError) as err:
        asyncio.run(AsyncEngine.preprocess(engine_obj, None, 1, input_ids=[1, 64]))
    assert err.value.code == ErrorCode.INVALID_REQUEST and "input_ids[1] = 64 is not a token id" in str(err.value)
    assert removed == [session]


@pytest.mark.parametrize("messages,message", [
    ([{"role": "user", "content": "hi"}, "hello"], "messages[1] must be an object with a role and a content, got str"),
    ([{"content": "hi"}], "messages[0] has no role (a string such as 'system', 'user' or 'assistant'), got None"),
    ([{"role": 3, "content": "hi"}], "messages[0] has no role"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list of parts, got int"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0] must be an object with a string type, got 'hi'"),
])
def test_malformed_messages_are_value_errors_naming_the_entry(messages, message):
    with pytest.raises(ValueError) as err:
        request_checks.check_messages(messages)
    assert str(err.value) == message or str(err.value).startswith(message), str(err.value)


def test_well_formed_messages_and_string_prompts_pass():
    request_checks.check_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": None, "tool_calls": []},
                                   {"role": "user", "content": [{"type": "text", "text": "x"}]}])
    request_checks.check_messages("a plain prompt")


def test_the_prompt_wrapper_checks_only_dlinfer_engines_processors_and_names_template_failures():
    calls = []

    async def original(self, prompt, *args, **kwargs):
        calls.append(prompt)
        raise KeyError("wizard")

    wrapped = request_checks._patch_get_prompt_input(original)
    with pytest.raises(KeyError):  # not a dlinfer engine's processor: LMDeploy's behaviour
        asyncio.run(wrapped(SimpleNamespace(), [{"content": "hi"}]))
    marked = SimpleNamespace(**{request_checks.MARK: "cpu"})
    with pytest.raises(ValueError, match="has no role"):
        asyncio.run(wrapped(marked, [{"content": "hi"}]))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="with the model's chat template: KeyError: 'wizard'"):
        asyncio.run(wrapped(marked, [{"role": "wizard", "content": "hi"}]))
