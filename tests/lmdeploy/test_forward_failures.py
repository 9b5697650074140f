"""patches/forward_failures.py in a live pipeline: a forward step that raises fails the requests in
flight, with an error, and the engine keeps serving (HF's greedy tokens after it). The fault is
injected with DLINFER_FAIL_FORWARD_TOKEN; the server-level cases are in tests/serving."""

from __future__ import annotations

import threading

import pytest
from lmdeploy import GenerationConfig
from support.engine_helpers import assert_matches_hf, cpu_pipeline, greedy_generate

from dlinfer.framework.lmdeploy_ext.patches import forward_failures

pytestmark = pytest.mark.slow

SHORT = ["The model token cache", "One two three four"]
POISON = "quick red river of the ocean"


def _poison_token(pipe) -> int:
    """A token of POISON's encoding that no SHORT prompt's encoding holds."""
    tokenizer = pipe.async_engine.tokenizer
    clean = {t for p in SHORT for t in tokenizer.encode(p, add_bos=True)}
    return next(t for t in tokenizer.encode(POISON, add_bos=False) if t not in clean)


@pytest.mark.parametrize("where", forward_failures.WHERE)
def test_a_failing_forward_fails_its_request_and_the_engine_serves_on(where, model_dir, hf_reference, monkeypatch):
    """At the step's start (no KV written), after the model ran (KV written, no output), or after
    the step queued its output (the request got a token; the next step is refused)."""
    reference = hf_reference("llama")
    with cpu_pipeline(model_dir("llama")) as pipe:
        monkeypatch.setenv("DLINFER_FAIL_FORWARD_TOKEN", f"{_poison_token(pipe)}:{where}")
        failed = greedy_generate(pipe, [POISON], 8)
        assert failed[0].finish_reason == "error" and len(failed[0].token_ids) <= (1 if where == "output" else 0)
        assert_matches_hf(greedy_generate(pipe, SHORT, 16), reference, 16)
        again = greedy_generate(pipe, [POISON], 8)  # the same fault again: the same answer
        assert again[0].finish_reason == "error"
        assert_matches_hf(greedy_generate(pipe, SHORT, 16), reference, 16)


def test_a_failed_prefill_leaves_nothing_in_the_prefix_cache(model_dir, hf_reference, monkeypatch):
    """The scheduler puts a prefill's blocks into the prefix cache when it schedules the step,
    before their KV is written. A request batched with a failing one fails with it; the same
    prompt sent again must not reuse those never-written blocks (HF's tokens, not garbage)."""
    reference = hf_reference("llama")
    long_prompt = " ".join(["one two three four five six seven eight"] * 6)  # several 16-token blocks
    with cpu_pipeline(model_dir("llama"), enable_prefix_caching=True) as pipe:
        monkeypatch.setenv("DLINFER_FAIL_FORWARD_TOKEN", f"{_poison_token(pipe)}:start")
        both = greedy_generate(pipe, [long_prompt, POISON], 8)
        assert [r.finish_reason for r in both] == ["error", "error"]
        assert_matches_hf(greedy_generate(pipe, [long_prompt], 16), reference, 16)


def test_requests_in_flight_when_a_forward_fails_end_with_an_error_not_a_hang(model_dir, hf_reference,
                                                                           monkeypatch):
    """A long generation is decoding when the poisoned prompt's prefill fails: the engine resets
    (the agent's decode state held the long one too), so the long one ends with an error; the
    engine then serves new requests with HF's tokens."""
    reference = hf_reference("llama")
    with cpu_pipeline(model_dir("llama")) as pipe:
        monkeypatch.setenv("DLINFER_FAIL_FORWARD_TOKEN", f"{_poison_token(pipe)}:model")
        gen = GenerationConfig(max_new_tokens=1900, do_sample=False, ignore_eos=True)
        decoding, chunks = threading.Event(), []

        def long_generation():
            for out in pipe.stream_infer([SHORT[0]], gen_config=gen, do_preprocess=False):
                chunks.append(out)
                if sum(len(c.token_ids) for c in chunks) >= 8:
                    decoding.set()
            decoding.set()

        worker = threading.Thread(target=long_generation)
        worker.start()
        assert decoding.wait(timeout=60)
        poisoned = greedy_generate(pipe, [POISON], 8)[0]
        worker.join(timeout=120)
        assert not worker.is_alive()
        assert poisoned.finish_reason == "error"
        streamed = sum(len(c.token_ids) for c in chunks)
        assert chunks[-1].finish_reason == "error" and 8 <= streamed < 1900, (chunks[-1].finish_reason, streamed)
        assert_matches_hf(greedy_generate(pipe, SHORT, 16), reference, 16)


def test_the_fault_setting_is_checked(monkeypatch):
    monkeypatch.setenv("DLINFER_FAIL_FORWARD_TOKEN", "5:later")
    with pytest.raises(ValueError, match=r"DLINFER_FAIL_FORWARD_TOKEN must be <token id>\[:start\|model\|output\]"):
        forward_failures.injected_fault(None, "start")


def test_only_agents_an_engine_loop_in_this_process_reads_recover():
    """An agent in another process (the mp executor, also at tp = 1) keeps LMDeploy's behaviour:
    its engine loop could not reset it, and a refused step would be refused for ever."""
    from types import SimpleNamespace

    agent = SimpleNamespace()
    assert not forward_failures._agent_applies(agent)
    assert not forward_failures._loop_applies(SimpleNamespace(executor=SimpleNamespace(device_type="cpu")))
    agent.__dict__[forward_failures._RECOVERS_ATTR] = True
    assert forward_failures._loop_applies(SimpleNamespace(executor=SimpleNamespace(model_agent=agent)))


def test_the_failure_message_is_one_line_naming_the_exception():
    assert forward_failures._message(IndexError("index out of range in self\nmore")) == \
        "IndexError: index out of range in self"
    assert forward_failures._message(RuntimeError()) == "RuntimeError"
