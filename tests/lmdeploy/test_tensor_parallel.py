"""tp=2 on device_type="cpu": LMDeploy's own multi-process executor, a gloo process group.

- Greedy tokens at tp=2 equal tp=1's and HF transformers' (float32) for tiny Llama, Qwen2, Mixtral
  and Qwen2-MoE (heads, KV heads, intermediate and expert sizes all divisible by 2): one tp=2 and
  one tp=1 engine per model, the same batch of prompts through both; the tp=2 engine leaves no
  rank process behind when closed. Graph mode (compiled decode steps) at tp=2 on Llama.
- A rank that fails ends the engine with an error naming the rank, within a bounded time, and no
  process of it is left: a rank killed with SIGKILL while serving, and a checkpoint one of whose
  weights no rank can load (a subprocess each, `tp_child.py`: the engine's end is the process's).
- What the ranks are given: the collective backend from the device type, cores // tp threads
  unless DLINFER_THREADS_PER_RANK says otherwise, LMDeploy's choice of the 'mp' executor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from support.engine_helpers import assert_matches_hf, cpu_pipeline, greedy_generate

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.backend.op_backend import backend_for
from dlinfer.framework.lmdeploy_ext.patches import mp_executor
from dlinfer.framework.lmdeploy_ext.patches.mp_executor import THREADS_ENV, threads_per_rank

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("tp_child.py")
MODELS = ("llama", "qwen2", "mixtral", "qwen2_moe")
NEW_TOKENS = 16
PROMPTS = (
    "Quick red river",
    "The model reads a prompt token by token and the engine keeps every key and value in the cache",
    "One two three four five six seven eight nine ten hundred thousand the first expert routes the "
    "second token to the last layer while a small blue window in the dark forest opens",
)
BUILD_TIMEOUT_S = 300   # a subprocess importing torch + LMDeploy and spawning two ranks, busy 2-core machine
END_TIMEOUT_S = 60      # from a rank's death to the end of the engine's process
ORPHAN_GRACE_S = 20     # mp_engine.ORPHAN_GRACE_S plus slack


def test_collective_backend_comes_from_the_device_type():
    assert backend_for(devices.CPU).ccl_backend() == "gloo"
    assert backend_for(devices.DLINFER_CUDA).ccl_backend() == "nccl"


def test_cpu_tp_runs_lmdeploys_mp_executor_unless_ray_is_asked_for():
    """The cpu backend supports Ray (patches/ray_executor.py), so LMDeploy's own choice for tp > 1
    with no executor named would be Ray; the engine config names 'mp' first."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.executor import get_distributed_executor_backend

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    assert PytorchEngineConfig(device_type="cpu", tp=2).distributed_executor_backend == "mp"
    assert get_distributed_executor_backend(2, 1, "cpu") == "ray"


@pytest.mark.parametrize("world_size,cores,env,expected", [
    (2, 2, {}, 1), (1, 2, {}, 2), (4, 2, {}, 1), (2, 16, {}, 8), (3, 16, {}, 5),
    (2, 2, {THREADS_ENV: "2"}, 2), (2, 16, {THREADS_ENV: " 3 "}, 3), (2, 2, {THREADS_ENV: ""}, 1),
])
def test_threads_per_rank(world_size, cores, env, expected):
    assert threads_per_rank(world_size, cores=cores, env=env) == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_threads_per_rank_refuses_a_bad_override(value):
    with pytest.raises(ValueError, match=f"{THREADS_ENV} must be an integer >= 1, got '{value}'"):
        threads_per_rank(2, cores=2, env={THREADS_ENV: value})


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_tp2_greedy_equals_tp1_and_hf(name, model_dir, hf_reference):
    with cpu_pipeline(model_dir(name), tp=2) as pipe:
        ranks = [psutil.Process(proc._proc.pid) for proc in pipe.async_engine.engine.executor.procs]
        assert len(ranks) == 2
        tp2 = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"rank processes left after close: {alive}"
    with cpu_pipeline(model_dir(name), tp=1) as pipe:
        tp1 = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert [r.token_ids for r in tp2] == [r.token_ids for r in tp1]
    assert_matches_hf(tp2, hf_reference(name), NEW_TOKENS)


@pytest.mark.slow
def test_tp2_graph_mode_matches_hf(model_dir, hf_reference):
    """eager_mode=False (LMDeploy's default): each rank compiles its decode steps, all-reduces
    inside the graph; same greedy tokens."""
    with cpu_pipeline(model_dir("llama"), tp=2, eager_mode=False, max_batch_size=4) as pipe:
        tp2 = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert_matches_hf(tp2, hf_reference("llama"), NEW_TOKENS)


def _tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries DLINFER_TP_TEST_TAG=tag (a child and its ranks)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DLINFER_TP_TEST_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


class Child:
    """tp_child.py in a subprocess, its output in a file, every process of it tagged."""

    def __init__(self, model: Path, log: Path):
        self.tag = uuid.uuid4().hex
        self.log = log
        env = dict(os.environ, DLINFER_TP_TEST_TAG=self.tag, PYTHONPATH=str(REPO))
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, str(CHILD), str(model)], cwd=REPO, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ranks(self) -> list[int]:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in self.text().splitlines():
                if line.startswith('{"ranks"'):
                    return json.loads(line)["ranks"]
            if self.proc.poll() is not None:
                pytest.fail(f"the tp=2 engine ended before it was built:\n{self.text()[-4000:]}")
            time.sleep(0.5)
        pytest.fail(f"the tp=2 engine was not built within {BUILD_TIMEOUT_S} s:\n{self.text()[-4000:]}")

    def wait_end(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the engine did not end within {timeout_s} s:\n{self.text()[-4000:]}")

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while (left := _tagged_processes(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for proc in left:
            proc.kill()
        assert not left, f"processes left behind: {[(p.pid, p.cmdline()[:3]) for p in left]}"

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        for proc in _tagged_processes(self.tag):
            proc.kill()


class _Rank:
    """What `watch_ranks` reads of LMDeploy's ExecutorProc: a rank number and its process."""

    def __init__(self, proc_id, proc):
        self.proc_id, self._proc = proc_id, proc


def _watched_executor(exit_code: int = 0, quick=None, lasting=None):
    """An executor stand-in with two rank processes (fork, not started): rank 1 `quick`, by default
    exiting with `exit_code` at once, and rank 0 `lasting`, by default living until it is ended;
    each given as (target, args)."""
    import multiprocessing
    import threading
    import types

    ctx = multiprocessing.get_context("fork")
    quick_fn, quick_args = quick or (os._exit, (exit_code,))
    lasting_fn, lasting_args = lasting or (time.sleep, (60,))
    quick, lasting = ctx.Process(target=quick_fn, args=quick_args), ctx.Process(target=lasting_fn, args=lasting_args)
    return types.SimpleNamespace(procs=[_Rank(0, lasting), _Rank(1, quick)],
                                 _dlinfer_releasing=threading.Event(), _dlinfer_rank_signalled=threading.Event())


def _watch(executor, after_exit=None):
    """Run `watch_ranks` over `executor`'s processes; `after_exit(executor)` runs once the quick
    rank has ended. Returns the statuses the watcher ended the process with."""
    exits = []
    lasting, quick = (rank._proc for rank in executor.procs)
    lasting.start()
    quick.start()
    try:
        thread = mp_executor.watch_ranks(executor, exit_process=exits.append)
        quick.join()
        if after_exit is not None:
            after_exit(executor)
        thread.join(mp_executor.SIGNAL_ARRIVAL_S + mp_executor.SIGNAL_GRACE_S + 5)
        assert not thread.is_alive()
    finally:
        lasting.kill()
        lasting.join()
    return exits


def test_the_watcher_ends_the_engine_when_a_rank_dies_without_a_word(caplog):
    executor = _watched_executor(exit_code=3)
    with caplog.at_level("ERROR", logger="dlinfer.lmdeploy"):
        assert _watch(executor) == [1]
    assert "tensor-parallel rank 1" in caplog.text and "exited with code 3" in caplog.text
    assert not executor.procs[0]._proc.is_alive()  # the other rank is ended too


def test_the_exit_code_is_read_while_another_thread_joins_the_rank():
    """Two threads joining one ended process: the one whose waitpid loses reads `exitcode` as None
    until the other has stored it (seen in CI: the watcher logged 'exited with code None' while the
    test joined the rank). Plain `join(1.0)` then `exitcode` read None in about 4% of these races."""
    import multiprocessing
    import threading
    from multiprocessing.connection import wait as wait_any

    ctx = multiprocessing.get_context("fork")
    codes = []
    for _ in range(150):
        proc = ctx.Process(target=os._exit, args=(3,))
        proc.start()
        wait_any([proc.sentinel])
        other = threading.Thread(target=proc.join)
        other.start()
        codes.append(mp_executor.exit_code(proc))
        other.join()
    assert codes == [3] * len(codes)


def _kill_myself():
    os.kill(os.getpid(), 9)


def _sleep_through_sigterm(ready):
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank blocked in a collective with a peer gone
    ready.set()
    time.sleep(60)


def test_a_rank_killed_by_a_signal_ends_the_engine_without_the_arrival_wait(caplog):
    """A rank SIGKILLed from outside never reported a failure: the watcher does not wait
    `SIGNAL_ARRIVAL_S` for its SIGUSR1, and kills a rank that outlives SIGTERM after
    `PEER_GONE_JOIN_S`, not `JOIN_TIMEOUT_S` (both waits were run out in full before: 2 + 10 s)."""
    import multiprocessing

    ready = multiprocessing.get_context("fork").Event()
    executor = _watched_executor(quick=(_kill_myself, ()), lasting=(_sleep_through_sigterm, (ready,)))
    lasting, quick = (rank._proc for rank in executor.procs)
    exits = []
    lasting.start()
    assert ready.wait(30)  # its SIGTERM handler is in place
    try:
        with caplog.at_level("ERROR", logger="dlinfer.lmdeploy"):
            quick.start()
            quick.join()
            ended = time.monotonic()
            thread = mp_executor.watch_ranks(executor, exit_process=exits.append)
            thread.join(mp_executor.SIGNAL_ARRIVAL_S + mp_executor.JOIN_TIMEOUT_S + 5)
            took = time.monotonic() - ended
        assert not thread.is_alive() and exits == [1]
        assert "tensor-parallel rank 1" in caplog.text and "was killed by signal 9" in caplog.text
        assert lasting.exitcode == -9  # it ignored SIGTERM: killed
        assert mp_executor.PEER_GONE_JOIN_S <= took < mp_executor.PEER_GONE_JOIN_S + mp_executor.SIGNAL_ARRIVAL_S, took
    finally:
        lasting.kill()
        lasting.join()


def test_a_rank_that_reported_its_failure_and_was_then_killed_leaves_the_caller_to_raise():
    """The SIGKILL fast path only skips a wait for a SIGUSR1 not yet seen: one seen before the kill
    still gives the waiting call its grace to raise (`RankFailedError`), and nothing is ended."""
    executor = _watched_executor(quick=(_kill_myself, ()))
    executor._dlinfer_rank_signalled.set()

    def release(executor):
        time.sleep(0.2)
        executor._dlinfer_releasing.set()  # what collective_rpc does before it raises RankFailedError

    assert _watch(executor, after_exit=release) == []


def test_the_watcher_leaves_the_caller_to_raise_when_the_signal_is_seen_after_the_exit():
    """The failing rank signals, then exits; the parent's handler may run after the watcher has
    seen the exit (the race CI hit): the watcher waits for it, and for the caller to release."""

    def signal_late_then_release(executor):
        time.sleep(mp_executor.SIGNAL_ARRIVAL_S / 4)
        executor._dlinfer_rank_signalled.set()
        time.sleep(0.2)
        executor._dlinfer_releasing.set()  # what collective_rpc does before it raises RankFailedError

    assert _watch(_watched_executor(exit_code=0), after_exit=signal_late_then_release) == []


def test_the_watcher_ends_the_engine_when_a_signalled_failure_leaves_every_rank_running(monkeypatch, caplog):
    """A rank signals its failure, but its clean-up blocks and no rank ends, and the engine's call
    never returns: the watcher ends the ranks and the process once the grace has passed."""
    import multiprocessing
    import threading
    import types

    monkeypatch.setattr(mp_executor, "STUCK_AFTER_SIGNAL_S", 1.0)
    ctx = multiprocessing.get_context("fork")
    ranks = [_Rank(i, ctx.Process(target=time.sleep, args=(60,))) for i in range(2)]
    executor = types.SimpleNamespace(procs=ranks, _dlinfer_releasing=threading.Event(),
                                     _dlinfer_rank_signalled=threading.Event())
    exits = []
    for rank in ranks:
        rank._proc.start()
    try:
        with caplog.at_level("ERROR", logger="dlinfer.lmdeploy"):
            thread = mp_executor.watch_ranks(executor, exit_process=exits.append)
            executor._dlinfer_rank_signalled.set()
            thread.join(10 + mp_executor.JOIN_TIMEOUT_S)
        assert not thread.is_alive() and exits == [1]
        assert "no rank has ended" in caplog.text
        assert not any(rank._proc.is_alive() for rank in ranks)
    finally:
        for rank in ranks:
            rank._proc.kill()
            rank._proc.join()


@pytest.mark.slow
def test_a_killed_rank_ends_the_engine(model_dir, tmp_path):
    child = Child(model_dir("llama"), tmp_path / "child.log")
    try:
        ranks = child.wait_ranks()
        time.sleep(1.0)  # let it decode a little
        os.kill(ranks[1], 9)
        code = child.wait_end(END_TIMEOUT_S)
        assert code != 0
        assert f"tensor-parallel rank 1 (pid {ranks[1]}) was killed by signal 9" in child.text()
        child.assert_nothing_left()
    finally:
        child.cleanup()


def _with_bad_weight(model: Path, folder: Path) -> Path:
    """A copy of `model` whose first layer's o_proj weight has the wrong shape (no rank can load it)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    key = "model.layers.0.self_attn.o_proj.weight"
    weights[key] = torch.zeros(weights[key].shape[0] + 2, weights[key].shape[1] - 2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.slow
def test_a_rank_that_cannot_load_its_weights_ends_the_engine(model_dir, tmp_path):
    child = Child(_with_bad_weight(model_dir("llama"), tmp_path / "bad"), tmp_path / "child.log")
    try:
        code = child.wait_end(BUILD_TIMEOUT_S)
        text = child.text()
        assert code != 0 and '{"ranks"' not in text
        # the build call raises, naming it; or, where the failing rank's clean-up blocks so that the
        # call never returns, the rank watcher ends the engine (STUCK_AFTER_SIGNAL_S later)
        assert ("RankFailedError: a tensor-parallel rank failed in 'build_model'" in text
                or "reported a failure 20 s ago, but no rank has ended" in text), text[-4000:]
        assert "Attempted to load weight (torch.Size([130, 63]))" in text, text[-4000:]  # the rank's traceback
        child.assert_nothing_left()
    finally:
        child.cleanup()
