"""`python -m dlinfer serve`: LMDeploy's OpenAI-compatible server on device_type="cpu".

One server (a tiny Llama, 127.0.0.1, a free port) answers the tests in file order; the last one
stops it with SIGTERM and checks that no process it started is left. The engine runs in a child
process (LMDeploy's multi-process engine, started with spawn), which imports the adaptor through
its entry point (patches/mp_engine.py). Every wait is bounded.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from support.broken_models import gguf_file, truncated
from support.engine_helpers import cpu_pipeline

from dlinfer.framework.lmdeploy_ext import serve

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180  # two interpreters importing torch + LMDeploy on a busy 2-core machine
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
NEW_TOKENS = 12
# The tiny model's greedy answer to this prompt is 12 tokens that each decode to whole characters.
# (Random weights often pick lone bytes of a multi-byte character: LMDeploy's incremental
# detokenizer then holds text back or not depending on how the tokens were grouped in the
# stream, so the *text* of the same tokens can differ between two runs; the tokens do not.)
MESSAGES = [{"role": "user", "content": "Answer small five by prefill eight"}]
# What tests/support/engine_helpers.cpu_pipeline runs, as server options.
ENGINE_OPTIONS = ("--eager-mode", "--cache-block-seq-len", "16", "--num-gpu-blocks", "128", "--max-batch-size", "32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m dlinfer serve` in a subprocess; its log in a file, its URL once it answers."""

    def __init__(self, model: Path, log: Path, *options: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dlinfer", "serve", self.model, "--server-name", "127.0.0.1",
                 "--server-port", str(self.port), "--log-level", "WARNING", *ENGINE_OPTIONS, *options],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.descendants: list[psutil.Process] = []

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before answering:\n{self.log_tail()}")
            try:
                status, _ = self.request("GET", "/v1/models", timeout=5)
                if status == 200:
                    self.descendants = psutil.Process(self.proc.pid).children(recursive=True)
                    return
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail(f"server did not answer within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def request(self, method: str, path: str, body=None, timeout: float = REQUEST_TIMEOUT_S):
        """(HTTP status, decoded JSON or raw text) for one request; HTTP errors are returned, not raised."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read().decode()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw

    def chat(self, messages, max_tokens: int = NEW_TOKENS, **extra):
        body = dict(model=self.model, messages=messages, temperature=0, max_tokens=max_tokens, **extra)
        status, answer = self.request("POST", "/v1/chat/completions", body)
        assert status == 200, (status, answer)
        return answer

    def stop(self, sig=signal.SIGTERM) -> int | None:
        """Signal the server; wait for it; kill what is left of the processes it started."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        _, alive = psutil.wait_procs(self.descendants, timeout=STOP_TIMEOUT_S)
        for proc in alive:
            proc.kill()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir("llama"), tmp_path_factory.mktemp("serve") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def greedy_reference(model_dir):
    """The pipeline's greedy answer (in-process engine) to MESSAGES: (token ids, text)."""
    from lmdeploy import GenerationConfig

    with cpu_pipeline(model_dir("llama")) as pipe:
        out = pipe([MESSAGES], gen_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False))[0]
        pieces = [pipe.async_engine.tokenizer.decode([t]) for t in out.token_ids]
    assert len(out.token_ids) == NEW_TOKENS and len(set(out.token_ids)) > 1, out
    assert not any("\ufffd" in piece for piece in pieces), f"pick another prompt (see MESSAGES): {pieces}"
    return list(out.token_ids), out.text


def test_models_lists_the_served_model(server):
    status, models = server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [server.model], models
    assert any(p.name() == "ZMQMPEngine" for p in server.descendants), server.descendants  # the engine's process


def test_greedy_chat_equals_the_pipeline(server, greedy_reference):
    tokens, text = greedy_reference
    answer = server.chat(MESSAGES, return_token_ids=True)
    choice = answer["choices"][0]
    assert choice["output_ids"] == tokens and choice["message"]["content"] == text, (choice, greedy_reference)
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == NEW_TOKENS


def test_streaming_with_the_openai_client(server, greedy_reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    stream = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                            max_tokens=NEW_TOKENS, stream=True)
    chunks = [chunk.choices[0] for chunk in stream]
    assert len(chunks) > 2, chunks  # pieces as they come, not one answer
    assert "".join(c.delta.content or "" for c in chunks) == greedy_reference[1]
    assert chunks[-1].finish_reason == "length"


def test_sixteen_concurrent_requests_all_answered(server):
    prompts = [f"{word} {i} the model reads the prompt" for i, word in
               enumerate(["one", "two", "red", "blue", "river", "city", "ocean", "forest"] * 2)]

    def ask(prompt):
        return server.chat([{"role": "user", "content": prompt}], max_tokens=8)

    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts, timeout=REQUEST_TIMEOUT_S))
    for answer in answers:
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length", answer
    assert time.monotonic() - start < REQUEST_TIMEOUT_S


@pytest.mark.parametrize("body,status,message", [
    (b"{not json", 400, "JSON decode error"),
    ({"messages": None}, 400, "messages"),
    ({"messages": MESSAGES, "max_tokens": -3}, 400, "max_tokens -3 must be a positive integer"),
    ({"messages": MESSAGES, "model": "no-such-model"}, 404, "does not exist"),
])
def test_malformed_request_is_4xx_and_the_server_keeps_serving(server, greedy_reference, body, status, message):
    if isinstance(body, dict):
        body = {"model": server.model, **body}
    got, answer = server.request("POST", "/v1/chat/completions", body)
    assert got == status and message in answer["message"], (got, answer)
    choice = server.chat(MESSAGES, return_token_ids=True)["choices"][0]
    assert (choice["output_ids"], choice["message"]["content"]) == greedy_reference


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
    choice = server.chat(MESSAGES, return_token_ids=True)["choices"][0]
    assert (choice["output_ids"], choice["message"]["content"]) == greedy_reference


def test_a_body_over_the_limit_is_413_before_it_is_read(server, greedy_reference):
    """LMDeploy read any body (patch: body_limit.py, DLINFER_SERVE_MAX_BODY, 64M by default): the
    headers alone announce 1 GB, none of it is sent, and the answer comes at once."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(2**30))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413, response.read()
    assert "over the limit of 67108864 bytes" in json.loads(response.read())["error"]["message"]
    conn.close()
    choice = server.chat(MESSAGES, return_token_ids=True)["choices"][0]
    assert (choice["output_ids"], choice["message"]["content"]) == greedy_reference


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
    choice = server.chat(MESSAGES, return_token_ids=True)["choices"][0]
    assert (choice["output_ids"], choice["message"]["content"]) == greedy_reference


def test_sigterm_shuts_down_cleanly_with_no_engine_process_left(server):
    """Runs last: stops the module's server."""
    engine = [p for p in server.descendants if p.name() == "ZMQMPEngine"]
    assert engine and all(p.is_running() for p in engine), server.descendants
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down, then re-raises the signal it caught: -SIGTERM is a clean exit too
    assert server.proc.wait(STOP_TIMEOUT_S) in (0, -signal.SIGTERM), server.log_tail()
    _, alive = psutil.wait_procs(server.descendants, timeout=STOP_TIMEOUT_S)
    assert alive == [], f"left running after SIGTERM: {alive}\n{server.log_tail()}"
    assert time.monotonic() - start < STOP_TIMEOUT_S
    log = server.log_tail()
    assert "Application shutdown complete" in log and "Finished server process" in log, log


def test_engine_process_exits_when_the_server_is_killed(model_dir, tmp_path):
    """SIGKILL gives the server no shutdown: the engine process (weights + KV cache in RAM) notices
    its parent is gone and exits by itself (patches/mp_engine.py)."""
    srv = Server(model_dir("llama"), tmp_path / "server.log")
    try:
        srv.wait_ready()
        engine = [p for p in srv.descendants if p.name() == "ZMQMPEngine"]
        assert engine, srv.descendants
        srv.proc.kill()
        srv.proc.wait(STOP_TIMEOUT_S)
        _, alive = psutil.wait_procs(srv.descendants, timeout=STOP_TIMEOUT_S)
        assert alive == [], f"orphaned: {alive}"
    finally:
        srv.stop()


def test_server_exits_when_its_engine_process_dies(model_dir, tmp_path):
    """A dead engine used to leave the server answering errors forever, so a supervisor that
    restarts on exit never fired: now it exits with status 3 within seconds (patches/mp_engine.py)."""
    from dlinfer.framework.lmdeploy_ext.patches.mp_engine import ENGINE_DIED_STATUS

    srv = Server(model_dir("llama"), tmp_path / "server.log")
    try:
        srv.wait_ready()
        (engine,) = [p for p in srv.descendants if p.name() == "ZMQMPEngine"]
        engine.kill()
        assert srv.proc.wait(30) == ENGINE_DIED_STATUS
        assert "the engine process (pid" in (tmp_path / "server.log").read_text()
        _, alive = psutil.wait_procs(srv.descendants, timeout=STOP_TIMEOUT_S)
        assert alive == [], f"left running: {alive}"
    finally:
        srv.stop()


def test_sigterm_cancels_a_long_generation_after_the_shutdown_bound(model_dir, tmp_path, monkeypatch):
    """SIGTERM used to wait for every in-flight generation (76 s seen); DLINFER_SERVE_SHUTDOWN_S
    bounds it (serve.py): here 1 s against a stream that would run for tens of seconds."""
    import threading

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
        _, alive = psutil.wait_procs(srv.descendants, timeout=STOP_TIMEOUT_S)
        assert alive == [], f"left running after SIGTERM: {alive}"
    finally:
        srv.stop()


def test_a_bad_shutdown_bound_is_one_line(model_dir, monkeypatch, capsys):
    from lmdeploy.serve.openai import api_server

    monkeypatch.setattr(api_server, "serve", lambda *a, **k: pytest.fail("server started"))
    monkeypatch.setenv("DLINFER_SERVE_SHUTDOWN_S", "soon")
    assert serve.main([str(model_dir("llama"))]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("python -m dlinfer serve: error: DLINFER_SERVE_SHUTDOWN_S must be a number of seconds >= 0, "
                   "got 'soon'")


def test_tensor_parallel_server_answers_and_stops_with_its_ranks(model_dir, tmp_path, greedy_reference):
    """`serve MODEL --tp 2`: the engine process runs LMDeploy's mp executor with two rank processes
    (gloo); the server answers with the tp=1 pipeline's greedy tokens, and SIGTERM ends all of it."""
    srv = Server(model_dir("llama"), tmp_path / "server.log", "--tp", "2")
    try:
        srv.wait_ready()
        engine = [p for p in srv.descendants if p.name() == "ZMQMPEngine"]
        assert len(engine) == 1 and len(engine[0].children()) >= 2, srv.descendants  # its rank processes
        choice = srv.chat(MESSAGES, return_token_ids=True)["choices"][0]
        assert (choice["output_ids"], choice["message"]["content"]) == greedy_reference
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(STOP_TIMEOUT_S) in (0, -signal.SIGTERM), srv.log_tail()
        _, alive = psutil.wait_procs(srv.descendants, timeout=STOP_TIMEOUT_S)
        assert alive == [], f"left running after SIGTERM: {alive}\n{srv.log_tail()}"
    finally:
        srv.stop()


def test_pipeline_with_the_multi_process_engine(model_dir, greedy_reference):
    """`enable_mp_engine=True` outside the server: the engine's spawned process imports the adaptor
    by itself; same greedy tokens as the in-process engine."""
    from lmdeploy import GenerationConfig

    with cpu_pipeline(model_dir("llama"), enable_mp_engine=True) as pipe:
        engine = pipe.async_engine.engine
        assert type(engine).__name__ == "ZMQMPEngine" and engine.proc.is_alive()
        child = psutil.Process(engine.proc.pid)
        out = pipe([MESSAGES], gen_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False))[0]
    assert list(out.token_ids) == greedy_reference[0]
    assert psutil.wait_procs([child], timeout=STOP_TIMEOUT_S)[1] == []  # closing the pipeline ended it


# The command line, without starting a server ---------------------------------------------------

def test_cli_defaults_are_the_devices(model_dir, monkeypatch):
    """LMDeploy's own `serve api_server` path builds the engine config; dlinfer's defaults reach it."""
    from lmdeploy.serve.openai import api_server

    from dlinfer.framework.lmdeploy_ext import devices

    captured = {}
    monkeypatch.setattr(api_server, "serve", lambda model_path, **kwargs: captured.update(kwargs, model=model_path))
    model = str(model_dir("llama"))
    assert serve.main([model, "--server-port", "1234", "--dtype", "float32"]) == 0
    config = captured["backend_config"]
    assert (config.device_type, config.dtype, captured["backend"]) == ("cpu", "float32", "pytorch")
    assert config.cache_max_entry_count == devices.CPU.cache_max_entry_count
    assert config.max_prefill_token_num == devices.CPU.max_prefill_token_num
    assert config.max_batch_size == devices.CPU.max_batch_size
    assert (captured["server_port"], captured["model_name"], captured["model"]) == (1234, model, model)

    assert serve.main([model, "--cache-max-entry-count", "0.2", "--max-prefill-token-num", "64"]) == 0
    config = captured["backend_config"]
    assert (config.cache_max_entry_count, config.max_prefill_token_num) == (0.2, 64)


@pytest.mark.parametrize("options,message", [
    (["--ep", "2"], "has no expert parallel: ep must be 1"),
    (["--tp", "0"], "tp must be at least 1"),
    (["--dtype", "float16"], "cannot run dtype='float16'"),
    (["--num-gpu-blocks", "4"], "num_gpu_blocks must be 0"),
])
def test_cli_refuses_what_the_device_cannot_run_in_one_line(options, message, model_dir, monkeypatch, capsys):
    from lmdeploy.serve.openai import api_server

    monkeypatch.setattr(api_server, "serve", lambda *a, **k: pytest.fail("server started"))
    assert serve.main([str(model_dir("llama")), *options]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dlinfer serve: error: ") and message in err and "\n" not in err, err


def test_cli_refuses_a_model_the_device_cannot_run_in_one_line(model_dir, monkeypatch, capsys):
    """The model check runs in the CLI's process, before LMDeploy's server starts its engine
    process (where it would end in a traceback there and another here)."""
    from lmdeploy.serve.openai import api_server

    monkeypatch.setattr(api_server, "serve", lambda *a, **k: pytest.fail("server started"))
    assert serve.main([str(model_dir("gemma2"))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dlinfer serve: error: device_type='cpu' cannot run architecture "
                          "'Gemma2ForCausalLM'") and "\n" not in err, err


def _copy_without(model_dir, tmp_path, *missing):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(model_dir("llama"), dst)
    for name in missing:
        (dst / name).unlink()
    return dst


@pytest.mark.parametrize("make,message", [
    (lambda d, t: t / "missing", "MODEL '{path}' does not exist."),
    (lambda d, t: gguf_file(t), "MODEL '{path}' is a GGUF file;"),
    (lambda d, t: (t / "empty").mkdir() or t / "empty", "MODEL '{path}' has no config.json"),
    (lambda d, t: _copy_without(d, t, "tokenizer.json", "tokenizer_config.json"), "MODEL '{path}' has no tokenizer"),
    (lambda d, t: truncated(_copy_without(d, t), 100), "model.safetensors is truncated"),
    (lambda d, t: "no-such-org/no-such-model", "MODEL 'no-such-org/no-such-model' is not a local folder, and "
                                                "fetching it as a model id failed"),
])
def test_cli_refuses_what_is_not_a_model_folder_in_one_line(make, message, model_dir, tmp_path, monkeypatch, capsys):
    from lmdeploy.serve.openai import api_server

    monkeypatch.setattr(api_server, "serve", lambda *a, **k: pytest.fail("server started"))
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub id case: no network is asked for
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    path = str(make(model_dir, tmp_path))
    assert serve.main([path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dlinfer serve: error: ") and message.format(path=path) in err, err
    assert "\n" not in err, err


def test_cli_device_choices_are_dlinfers():
    from dlinfer.framework.lmdeploy_ext import devices

    parser = serve.build_parser()
    device = next(a for a in parser._actions if a.dest == "device")
    assert device.choices == list(devices.DEVICES) and device.default == "cpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["model", "--device", "cuda"])
    with pytest.raises(SystemExit):
        parser.parse_args(["model", "--backend", "turbomind"])


# The engine process's entry point (patches/mp_engine.py), without an engine ----------------------

def test_spawn_pickles_dlinfers_entry_point():
    """Spawn pickles the target by module and name: the child imports dlinfer's module, which
    imports (and applies) the adaptor before LMDeploy's `_mp_proc` runs."""
    import pickle

    from lmdeploy.pytorch.engine.mp_engine.zmq_engine import ZMQMPEngine

    from dlinfer.framework.lmdeploy_ext.patches import mp_engine

    target = ZMQMPEngine._mp_proc  # what `mp_ctx.Process(target=self._mp_proc)` gets
    assert target is mp_engine.engine_process
    assert b"dlinfer.framework.lmdeploy_ext.patches.mp_engine" in pickle.dumps(target)


def test_port_hand_off_survives_the_manager_shutting_down():
    from dlinfer.framework.lmdeploy_ext.patches.mp_engine import PortHandOff

    class Proxy:  # a Manager ConditionProxy whose manager shut down before it answered `release`
        entered = notified = False

        def __enter__(self):
            self.entered = True

        def __exit__(self, *exc_info):
            raise EOFError

        def notify(self):
            self.notified = True

    proxy = Proxy()
    with PortHandOff(proxy) as condition:
        PortHandOff(proxy).notify()
    assert proxy.entered and proxy.notified and condition is None
