"""`python -m dlinfer serve` in a subprocess, for the server tests (tests/lmdeploy/test_serve.py,
tests/serving): a tiny model on 127.0.0.1 at a free port, its log in a file, every wait bounded,
and what it started stopped at the end."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from support.engine_helpers import cpu_pipeline

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m dlinfer serve` in a subprocess; its log in a file, its URL once it answers."""

    def __init__(self, model: Path, log: Path, *options: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dlinfer", "serve", self.model, "--server-name", "127.0.0.1",
                 "--server-port", str(self.port), "--log-level", "WARNING", *ENGINE_OPTIONS, *options],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
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

    def engines(self) -> list:
        """The engine processes (LMDeploy's ZMQMPEngine) among the processes the server started."""
        return [p for p in self.descendants if p.name() == "ZMQMPEngine"]

    def assert_nothing_left(self, what: str = "left running") -> None:
        """Every process the server started has exited (within STOP_TIMEOUT_S)."""
        _, alive = psutil.wait_procs(self.descendants, timeout=STOP_TIMEOUT_S)
        assert alive == [], f"{what}: {alive}\n{self.log_tail()}"

    def sigterm_and_wait(self) -> None:
        """SIGTERM: the server exits cleanly within STOP_TIMEOUT_S, and so does all it started."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(STOP_TIMEOUT_S) in (0, -signal.SIGTERM), self.log_tail()
        self.assert_nothing_left("left running after SIGTERM")

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



def greedy_reference_of(model: Path) -> tuple[list[int], str]:
    """The pipeline's greedy answer (in-process engine) to MESSAGES: (token ids, text)."""
    from lmdeploy import GenerationConfig

    with cpu_pipeline(model) as pipe:
        out = pipe([MESSAGES], gen_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False))[0]
        pieces = [pipe.async_engine.tokenizer.decode([t]) for t in out.token_ids]
    assert len(out.token_ids) == NEW_TOKENS and len(set(out.token_ids)) > 1, out
    assert not any("\ufffd" in piece for piece in pieces), f"pick another prompt (see MESSAGES): {pieces}"
    return list(out.token_ids), out.text
