"""`python -m dlinfer serve`: LMDeploy's OpenAI-compatible server on device_type="cpu".

One server (a tiny Llama, 127.0.0.1, a free port) answers the tests in file order; the last one
kills its engine process, which must end the server with status 3 and leave no process (the clean
SIGTERM stop is tests/serving/test_faults.py's last test). The engine runs in a child
process (LMDeploy's multi-process engine, started with spawn), which imports the adaptor through
its entry point (patches/mp_engine.py). Every wait is bounded. Faults (hostile requests, dying
processes, sleep, dropping clients) are driven in tests/serving.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from support.api_server import MESSAGES, NEW_TOKENS, REQUEST_TIMEOUT_S, STOP_TIMEOUT_S, Server, greedy_reference_of
from support.broken_models import gguf_file, truncated
from support.engine_helpers import cpu_pipeline

from dlinfer.framework.lmdeploy_ext import serve

pytestmark = pytest.mark.slow


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
    return greedy_reference_of(model_dir("llama"))


def test_models_lists_the_served_model(server):
    status, models = server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [server.model], models
    assert server.engines(), server.descendants  # the engine's process


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


def test_server_exits_when_its_engine_process_dies(server):
    """Runs last: ends the module's server. A dead engine used to leave the server answering errors
    forever, so a supervisor that restarts on exit never fired: now it exits with status 3 within
    seconds (patches/mp_engine.py). (A clean SIGTERM stop: tests/serving/test_faults.py's last test,
    after its faults; a SIGKILLed server's engine: tests/serving/test_images.py's.)"""
    from dlinfer.framework.lmdeploy_ext.patches.mp_engine import ENGINE_DIED_STATUS

    (engine,) = server.engines()
    engine.kill()
    assert server.proc.wait(30) == ENGINE_DIED_STATUS
    assert f"the engine process (pid {engine.pid}) died" in server.log.read_text(errors="replace")
    server.assert_nothing_left()


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
        engine = srv.engines()
        assert len(engine) == 1 and len(engine[0].children()) >= 2, srv.descendants  # its rank processes
        choice = srv.chat(MESSAGES, return_token_ids=True)["choices"][0]
        assert (choice["output_ids"], choice["message"]["content"]) == greedy_reference
        srv.sigterm_and_wait()
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
    assert serve.main([str(model_dir("starcoder2"))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dlinfer serve: error: device_type='cpu' cannot run architecture "
                          "'Starcoder2ForCausalLM'") and "\n" not in err, err


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
