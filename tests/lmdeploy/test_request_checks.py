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
