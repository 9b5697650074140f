"""Tensor parallel through LMDeploy's Ray executor on device_type="cpu" (patches/ray_executor.py).

One Ray cluster for the module: a head node started here (`ray start --head --block`, its own
process group, stopped at the end or when the test process dies), bound to 127.0.0.1
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray then takes the loopback address as every node's address),
with two CPUs and no token authentication (LOCAL_RAY_ENV); the engines reach it
through RAY_ADDRESS and leave it running. Every packet stays on this machine, every wait is
bounded, and the tests check that what they started is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from support.api_server import MESSAGES, STOP_TIMEOUT_S, Server, free_port, greedy_reference_of
from support.engine_helpers import assert_matches_hf, cpu_pipeline, greedy_generate

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = ["The model token cache", "One two three four five six seven"]
# What tests/conftest.py sets for the whole run (Ray reads the first when it is imported), and
# the Ray processes started here get too.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
assert all(os.environ.get(k) == v for k, v in LOCAL_RAY_ENV.items()), "tests/conftest.py sets these"


def _die_with_parent():
    """In the child: SIGTERM when the test process dies, however (the hang watchdog's os._exit
    skips every finally); `ray start --block` then stops the cluster."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _ray_processes(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_cluster_the_engine_starts_itself_ends_with_it(model_dir, hf_reference, monkeypatch):
    """No RAY_ADDRESS: LMDeploy's ray.init starts a local cluster (as many CPUs as ranks), here on
    the loopback address; closing the pipeline shuts it down, and no Ray process is left."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    me = psutil.Process()
    with _ray_pipeline(model_dir("llama")) as pipe:
        started = [p for p in me.children(recursive=True) if p.name() in ("raylet", "gcs_server")]
        assert len(started) == 2, me.children(recursive=True)
        assert_matches_hf(greedy_generate(pipe, PROMPTS, 8), hf_reference("llama"), 8)
    _, alive = psutil.wait_procs(started, timeout=STOP_TIMEOUT_S)
    assert alive == [] and not ray.is_initialized()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A one-node cluster on 127.0.0.1 with two CPUs for the module, in RAY_ADDRESS while it runs;
    yields its `ray start --block` process."""
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = dict(os.environ, **LOCAL_RAY_ENV)
    log = temp / "ray_start.log"
    with open(log, "wb") as out:
        head = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
             "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    address = f"127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", *LOCAL_RAY_ENV)}
    os.environ.update(LOCAL_RAY_ENV, RAY_ADDRESS=address)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text(errors="replace"):  # then it blocks until stopped
            assert head.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield head
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        started = _ray_processes(psutil.Process(head.pid))
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the cluster on SIGTERM
        _, alive = psutil.wait_procs(started, timeout=10)
        for proc in alive:  # what has not stopped by then (a raylet waiting on its workers)
            proc.kill()
        psutil.wait_procs(alive, timeout=STOP_TIMEOUT_S)


def _ray_pipeline(model_dir, **kwargs):
    return cpu_pipeline(model_dir, tp=2, distributed_executor_backend="ray", **kwargs)


@pytest.mark.parametrize("name,eager,channel", [("llama", True, True), ("llama", False, True),
                                                 ("mixtral", True, False)])
def test_tp2_over_ray_gives_hfs_greedy_tokens(name, eager, channel, ray_cluster, model_dir, hf_reference,
                                              monkeypatch):
    """Steps over the step connections (dlinfer's default), eager and compiled, and through
    LMDeploy's own per-step put and calls (DLINFER_RAY_STEP_CHANNEL=0) on the same actors, that
    one with a mixture of experts. What the executor carries does not depend on the model (each
    model's tp=2 split is test_tensor_parallel.py's, on the mp executor), and each case is an engine
    with two Ray workers starting: about a minute of CI on a 2-core machine."""
    from dlinfer.framework.lmdeploy_ext.ray_steps import StepChannels

    monkeypatch.setenv("DLINFER_RAY_STEP_CHANNEL", "1" if channel else "0")
    with _ray_pipeline(model_dir(name), eager_mode=eager) as pipe:
        executor = pipe.async_engine.engine.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor.workers) == 2
        assert_matches_hf(greedy_generate(pipe, PROMPTS, 12), hf_reference(name), 12)
        assert isinstance(executor._dlinfer_steps, StepChannels) == channel
        # every thread of each rank at the engine's niceness, not Ray's worker niceness (15)
        for worker in executor.workers:
            pid = ray.get(worker.get_pid.remote())
            threads = os.listdir(f"/proc/{pid}/task")
            assert {_niceness(pid, tid) for tid in threads} - {None} == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert not ray.is_initialized() and ray_cluster.poll() is None  # the driver left; the cluster runs on


def _niceness(pid: int, tid: str) -> int | None:
    """A thread's niceness (/proc/<pid>/task/<tid>/stat, field 19); None if it has ended."""
    try:
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()
    except FileNotFoundError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[16])


class _Records(logging.Handler):
    """The text of every record of a logger, tracebacks included."""

    def __init__(self):
        super().__init__()
        self.texts: list[str] = []

    def emit(self, record):
        self.texts.append(logging.Formatter().format(record))


@pytest.mark.parametrize("served_first", [False, True], ids=["before-any-step", "after-a-generation"])
def test_a_killed_rank_ends_the_engine_in_bounded_time(served_first, ray_cluster, model_dir):
    """A rank killed before the first step (the step connections are opened with one actor gone)
    or after steps ran over them: the next requests fail, and the pipeline closes, in bounded time."""
    from lmdeploy import GenerationConfig

    records = _Records()
    logging.getLogger("lmdeploy").addHandler(records)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False)
    with _ray_pipeline(model_dir("llama")) as pipe:
        if served_first:
            assert len(pipe(["The model token cache"], gen_config=gen)[0].token_ids) == 8
        workers = pipe.async_engine.engine.executor.workers
        pid = ray.get(workers[1].get_pid.remote())
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        for _ in range(2):  # the engine has ended: this request and the next fail at once
            out = pipe(["The model token cache"], gen_config=gen)[0]
            assert out.finish_reason == "error" and out.token_ids == [], out
        assert time.monotonic() - start < 60
    assert time.monotonic() - start < 90  # the close too
    logging.getLogger("lmdeploy").removeHandler(records)
    died = [t for t in records.texts if "ActorDiedError" in t]
    assert died and "name: dlinfer-cpu-tp-worker-1-" in died[0], records.texts[-3:]  # the error names the worker


def test_serve_over_ray_answers_and_stops(ray_cluster, model_dir, tmp_path):
    reference = greedy_reference_of(model_dir("llama"))
    srv = Server(model_dir("llama"), tmp_path / "server.log", "--tp", "2", "--distributed-executor-backend", "ray")
    try:
        srv.wait_ready()
        choice = srv.chat(MESSAGES, return_token_ids=True)["choices"][0]
        assert (choice["output_ids"], choice["message"]["content"]) == reference
        srv.sigterm_and_wait()
    finally:
        srv.stop()
