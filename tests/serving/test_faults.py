"""Faults against a live `python -m dlinfer serve` (issue 35): hostile requests, a forward that
raises, 64 concurrent clients of which some drop mid-stream, sleep, and processes that die or are
told to stop. After each, the server answers a greedy chat with the in-process pipeline's tokens,
or has exited as documented (docs/lmdeploy.md, "Serving"), and no process it started is left.

One server (a tiny Llama) takes the cases that leave it serving, in file order; it runs with
DLINFER_FAIL_FORWARD_TOKEN set, so a prefill holding that token raises inside the forward; the
last of them stops it with SIGTERM. The SIGTERM during a long generation starts a server of its
own (other options). Two more ends of a server are checked on other modules' servers, each a
server start fewer: an engine process that dies (tests/lmdeploy/test_serve.py) and a SIGKILLed
server whose engine exits by itself (tests/serving/test_images.py).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.api_server import MESSAGES, REQUEST_TIMEOUT_S, STOP_TIMEOUT_S, Server, greedy_reference_of

pytestmark = pytest.mark.slow

PROMPTS = [f"{word} {i} the model reads the prompt" for i, word in
           enumerate(["one", "two", "red", "blue", "river", "city", "ocean", "forest"])]


def _fail_token(model) -> int:
    """The tiny model's last token id, checked to be in none of the texts the tests send (a chat
    template that produced it would show as an error where the greedy chat is expected)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    token = AutoConfig.from_pretrained(model).vocab_size - 1
    texts = [m["content"] for m in MESSAGES] + PROMPTS + ["user", "assistant", "system", "\n"]
    assert not any(token in tokenizer.encode(text) for text in texts), "pick another fault token"
    return token


@pytest.fixture(scope="module")
def fail_token(model_dir):
    return _fail_token(model_dir("llama"))


@pytest.fixture(scope="module")
def server(model_dir, fail_token, tmp_path_factory):
    env = dict(os.environ, DLINFER_FAIL_FORWARD_TOKEN=str(fail_token))
    srv = Server(model_dir("llama"), tmp_path_factory.mktemp("faults") / "server.log", env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def greedy_reference(model_dir):
    return greedy_reference_of(model_dir("llama"))


def assert_serves(server, greedy_reference):
    status, health = server.request("GET", "/health")
    assert status == 200, (status, health)
    choice = server.chat(MESSAGES, return_token_ids=True)["choices"][0]
    assert (choice["output_ids"], choice["message"]["content"]) == greedy_reference


@pytest.mark.parametrize("body,status,message", [
    (b"{not json", 400, "JSON decode error"),
    ({"messages": None}, 400, "messages"),
    ({"messages": MESSAGES, "max_tokens": -3}, 400, "max_tokens -3 must be a positive integer"),
    ({"messages": MESSAGES, "model": "no-such-model"}, 404, "does not exist"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0] has no role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content must be a string or a list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "could not be turned into a prompt with the model's "
                                                               "chat template: KeyError: 'wizard'"),
])
def test_malformed_request_is_4xx_and_the_server_keeps_serving(server, greedy_reference, body, status, message):
    if isinstance(body, dict):
        body = {"model": server.model, **body}
    got, answer = server.request("POST", "/v1/chat/completions", body)
    assert got == status and message in answer["message"], (got, answer)
    assert_serves(server, greedy_reference)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [1, 2, 10**6], "max_tokens": 4}),
    ("/generate", {"input_ids": [1, -1, 2], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [], "input_ids": [1, 2, 10**6], "max_tokens": 4}),
])
def test_token_ids_outside_the_vocabulary_are_400_and_the_engine_lives(server, greedy_reference, path, body):
    """Such ids used to reach the engine's embedding and end the engine (issue 35): every later
    request got 503. patches/request_checks.py refuses them per request."""
    if path != "/generate":
        body = {"model": server.model, **body}
    bad = next(i for i in body["input_ids"] if not 0 <= i < 10**5)
    got, answer = server.request("POST", path, body)
    assert got == 400 and f"= {bad} is not a token id of this model" in answer["message"], (got, answer)
    assert_serves(server, greedy_reference)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": list(range(1, 101)) * 11, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "one two three " * 400, "max_tokens": 4}),
])
def test_a_prompt_longer_than_the_context_is_400_naming_the_lengths(server, greedy_reference, path, body):
    """LMDeploy's own length check, at the door: the prompt never reaches the engine."""
    if path != "/generate":
        body = {"model": server.model, **body}
    got, answer = server.request("POST", path, body)
    assert got == 400 and "must be smaller than the model context length (1024)" in answer["message"], (got, answer)
    assert_serves(server, greedy_reference)


def test_a_forward_that_raises_fails_its_request_and_the_server_serves_on(server, greedy_reference, fail_token):
    """patches/forward_failures.py: the exception used to end the engine (every later request 503,
    and under `serve` the server's exit); now the request gets an error and the engine resets."""
    for _ in range(2):
        got, answer = server.request("POST", "/generate", {"input_ids": [1, fail_token, 2], "max_tokens": 4})
        assert got == 500 and answer["type"] == "server_error", (got, answer)  # the details stay in the log
        assert_serves(server, greedy_reference)
    log = server.log_tail(20000)
    assert "InjectedForwardFault" in log and "engine reset after a failed forward step" in log, log


def _solo_answers(server) -> dict[str, list[int]]:
    return {p: server.chat([{"role": "user", "content": p}], max_tokens=8, return_token_ids=True)
            ["choices"][0]["output_ids"] for p in PROMPTS}


def _drop_mid_stream(server, prompt: str) -> bool:
    """A streaming chat whose client closes the connection after the first chunk; True once it has read one."""
    body = dict(model=server.model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=200,
                ignore_eos=True, stream=True)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status == 200 and bool(response.readline())
    finally:
        conn.sock.close() if conn.sock else None
        conn.close()


def test_64_concurrent_clients_with_some_dropping_mid_stream(server, greedy_reference):
    """56 chats and 8 streams whose clients hang up after the first chunk, all at once: every chat
    is answered with the tokens its prompt gets alone, and the server serves on."""
    solo = _solo_answers(server)
    jobs = [("chat", PROMPTS[i % len(PROMPTS)]) for i in range(56)] + [("drop", p) for p in PROMPTS]
    jobs = jobs[::7] + [j for i, j in enumerate(jobs) if i % 7]  # the drops spread among the chats

    def run(job):
        kind, prompt = job
        if kind == "drop":
            return kind, prompt, _drop_mid_stream(server, prompt)
        answer = server.chat([{"role": "user", "content": prompt}], max_tokens=8, return_token_ids=True)
        return kind, prompt, answer["choices"][0]

    start = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, jobs, timeout=REQUEST_TIMEOUT_S * 2))
    assert time.monotonic() - start < REQUEST_TIMEOUT_S * 2
    for kind, prompt, result in results:
        if kind == "drop":
            assert result, f"the dropping client of {prompt!r} read no chunk"
        else:
            assert result["finish_reason"] == "length" and result["output_ids"] == solo[prompt], (prompt, result)
    assert_serves(server, greedy_reference)
    assert _solo_answers(server) == solo


def test_a_body_over_the_limit_is_413_before_it_is_read(server, greedy_reference):
    """LMDeploy read any body (patch: body_limit.py, DLINFER_SERVE_MAX_BODY, 64M by default): the
    headers alone announce 1 GB, none of it is sent, and the answer comes at once."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(2**30))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413, response.read()
    assert "over the limit of 67108864 bytes" in json.loads(response.read())["error"]["message"]
    conn.close()
    assert_serves(server, greedy_reference)


def test_sleep_then_wakeup_serves_the_same_tokens(server, greedy_reference):
    """/sleep (level 1) drops the KV cache; /wakeup used to answer 500 on CPU (LMDeploy moves the
    weights back with torch.cuda) and leave the server asleep (patches/model_agent.py). Level 2 is
    refused (sleep_levels.py)."""
    status, body = server.request("POST", "/sleep?level=2", {})  # no weights to wake up to on the CPU
    assert status == 400 and "use level 1" in body["error"]["message"], body
    assert server.request("GET", "/is_sleeping")[1] == {"is_sleeping": False}
    assert server.request("POST", "/sleep?level=1", {})[0] == 200
    assert server.request("GET", "/is_sleeping")[1] == {"is_sleeping": True}
    assert server.request("POST", "/wakeup", {})[0] == 200
    assert server.request("GET", "/is_sleeping")[1] == {"is_sleeping": False}
    assert_serves(server, greedy_reference)


def test_sigterm_stops_the_server_cleanly_with_no_process_left(server):
    """Runs last: stops the module's server, after every fault above (a failed forward's reset,
    dropped streams, sleep and wakeup): uvicorn's shutdown completes, within the bound, and the
    engine process it started is gone."""
    engine = server.engines()
    assert engine and all(p.is_running() for p in engine), server.descendants
    start = time.monotonic()
    server.sigterm_and_wait()  # uvicorn re-raises the SIGTERM it caught: -SIGTERM is a clean exit too
    assert time.monotonic() - start < STOP_TIMEOUT_S
    log = server.log_tail()
    assert "Application shutdown complete" in log and "Finished server process" in log, log


def test_sigterm_cancels_a_long_generation_after_the_shutdown_bound(model_dir, tmp_path, monkeypatch):
    """SIGTERM used to wait for every in-flight generation (76 s seen); DLINFER_SERVE_SHUTDOWN_S
    bounds it (serve.py): here 1 s against a stream that would run for tens of seconds."""
    monkeypatch.setenv("DLINFER_SERVE_SHUTDOWN_S", "1")
    srv = Server(model_dir("llama"), tmp_path / "server.log", "--session-len", "8192", "--num-gpu-blocks", "512")
    streamed = threading.Event()

    def long_stream():
        body = dict(model=srv.model, messages=MESSAGES, temperature=0, max_tokens=7000, ignore_eos=True, stream=True)
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                for _ in resp:
                    streamed.set()
        except OSError:
            pass  # the server goes away mid-stream: what this test causes

    try:
        srv.wait_ready()
        threading.Thread(target=long_stream, daemon=True).start()
        assert streamed.wait(60), srv.log_tail()
        time.sleep(1.0)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(STOP_TIMEOUT_S) in (0, -signal.SIGTERM), srv.log_tail()
        assert time.monotonic() - start < 1 + 10 + 5, srv.log_tail()  # the bound, the engine's close, slack
        srv.assert_nothing_left("left running after SIGTERM")
    finally:
        srv.stop()
