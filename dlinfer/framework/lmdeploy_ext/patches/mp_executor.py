"""Tensor parallel through LMDeploy's multi-process executor (written against LMDeploy 0.18.0).

Why: with `tp > 1` LMDeploy builds `MPExecutor` (engine/executor/mp_executor.py), which starts
one process per rank with multiprocessing *spawn*; the target is the bound method
`ExecutorProc._main_loop`, so the rank process imports LMDeploy but not dlinfer's adaptor (unless
the parent's main module happens to). Six things go wrong for a dlinfer device type there:
1. Without the adaptor's patches, the rank's `init_backend("cpu")` raises (unknown device type).
2. The rank's `init_process_group` (dist_utils.py) asks `get_backend()` of LMDeploy's
   *current* device context, which in a fresh rank process is the default, "cuda": the process
   group would be built with "nccl" whatever the device type.
3. `_main_loop` calls `torch.cuda.set_device(rank)` (mp_executor.py): no CUDA on a CPU host.
4. Every rank starts torch's default thread pool, one thread per core: two ranks on two cores
   run four compute threads, and each rank's collectives wait for the slowest oversubscribed one.
5. A rank that fails ends the engine through a SIGUSR1 handler in the parent (mp_executor.py:
   260-266) that closes LMDeploy's shared-memory notifiers from inside the main thread's
   interrupted wait on one of them: `Event.set` then waits for that same sleeper, and the parent
   hangs for ever (seen: a rank failing in `init_process_group`). A rank killed from outside
   (SIGKILL, the OOM killer) sends nothing at all: the parent waits for its reply for ever. A
   parent killed from outside leaves its ranks, which hold the weights, running.

6. LMDeploy's shared-memory command channel (`Notifier`, mp_executor.py) makes its
   senders and receivers meet at a multiprocessing barrier every 32 messages, and the async
   paths wait at it *synchronously*, blocking the event loop. A rank that blocks there while
   another rank's forward task sits in a collective waiting for it deadlocks: on a GPU the
   collectives are asynchronous, on the CPU gloo's are not. Seen: SmolLM2-135M at tp=3 hung
   after about 1000 collectives, rank 0 in gloo's `Work::wait`, rank 1 in the barrier.

How, for dlinfer's device types only (`devices/specs.py`; other device types get LMDeploy's code):
- `ExecutorProc.start` starts the rank with `rank_process`, a function of this module, as target
  (spawn pickles it by module and name, so the rank imports this module, hence the adaptor and all
  its patches, before anything is built: 1). `rank_process` sets the rank's threads (4,
  `threads_per_rank`), arranges that the rank exits with its parent (`mp_engine.exit_with_parent`),
  then runs LMDeploy's `_main_loop` unchanged inside LMDeploy's device context of its device type,
  which the rank process serves alone (2).
- The async waits at the barrier (`Notifier.wait_async`, `Notifier.set_async`) of the notifiers
  a dlinfer executor and its ranks hold run in the event loop's thread pool instead, so the
  loop keeps running the forward task, whose collectives the other ranks wait for (6). Only
  those notifier instances are changed; the synchronous `wait`/`set` (engine build, messages over
  1 MiB) stay as they are.
- `mp_executor`'s module-global `torch` gets host CUDA semantics where this process has no usable
  CUDA device (`cuda_calls.py`; `set_device` is a no-op there: 3).
- `MPExecutor.__init__`, once the ranks are started, replaces LMDeploy's SIGUSR1 handler by one that
  only records the failure, and starts `watch_ranks`: a daemon thread that waits on the ranks'
  process sentinels and, when one ends while the executor is not releasing, logs which rank ended
  and how, terminates the other ranks (SIGKILL after `PEER_GONE_JOIN_S`) and ends this process with
  status 1, as LMDeploy's handler means to (5); likewise (SIGKILL after `JOIN_TIMEOUT_S`) when a
  rank has signalled its failure but, `STUCK_AFTER_SIGNAL_S` later, no rank has ended and the
  waiting call has not raised (a failing rank's clean-up blocked on its peer). A failing rank's
  own clean-up wakes the parent's wait for its reply with no reply (LMDeploy then fails later on a
  None); `collective_rpc` (every call while the engine is built) raises `RankFailedError`
  instead, after ending the ranks, so a rank that cannot load its weights makes `pipeline(...)`
  raise, naming the call.
  `ExecutorProc.join` waits at most `JOIN_TIMEOUT_S` for a terminated rank, then kills it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import types
from contextlib import asynccontextmanager
from multiprocessing.connection import wait

from dlinfer import envs
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap

# Environment variable: compute threads per rank (an integer >= 1), overriding `threads_per_rank`.
THREADS_ENV = "DLINFER_THREADS_PER_RANK"
# Seconds `ExecutorProc.join` waits for a terminated rank before it kills it.
JOIN_TIMEOUT_S = 10.0
# Seconds the rank watcher leaves a call that waits on a rank which signalled its failure to raise
# `RankFailedError` in the caller before it ends the process instead.
SIGNAL_GRACE_S = 5.0
# Seconds the rank watcher waits, once a rank has ended, for that rank's SIGUSR1 to be seen: the
# rank signals and then exits, but Python runs the handler in the main thread, which may get to
# it after the watcher thread has seen the exit (seen in CI on a loaded 2-core machine).
SIGNAL_ARRIVAL_S = 2.0
# Seconds the rank watcher waits, once a rank has signalled its failure, for a rank to end or the
# waiting call to raise: a failing rank's clean-up (LMDeploy's `_main_loop`: stop, release, the
# process group's destruction) can block on a peer that is itself waiting for it; seen once in a
# full suite run, the engine then hung for good.
STUCK_AFTER_SIGNAL_S = 20.0
# Seconds the rank watcher gives the other ranks, once a rank has ended, between SIGTERM and SIGKILL:
# a rank whose peer is gone is usually blocked in a collective that can no longer complete (seen:
# the survivor of a killed rank always ran out `JOIN_TIMEOUT_S`), and this process ends next.
PEER_GONE_JOIN_S = 2.0
# How long the rank watcher reads an ended rank's exit code (`exit_code`) before it logs it as unknown.
EXIT_CODE_WAIT_S = 1.0

logger = logging.getLogger("dlinfer.lmdeploy")


def host_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(world_size: int, cores: int | None = None, env: dict | None = None) -> int:
    """Compute threads of each of `world_size` ranks sharing this machine's cores: the integer in
    $DLINFER_THREADS_PER_RANK if set (>= 1), else cores // world_size, at least 1."""
    value = envs.get(THREADS_ENV, env)
    if value is not None:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"{THREADS_ENV} must be an integer >= 1, got {value!r}.")
        return threads
    cores = host_cores() if cores is None else cores
    return max(1, cores // max(1, world_size))


@asynccontextmanager
async def _wait_async(self):
    """`Notifier.wait_async` with its barrier waits off the event loop's thread."""
    from lmdeploy.pytorch.engine.executor.mp_executor import NUM_SHARED_BLOCK

    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, self.events[self._event_id].wait)
    yield
    if self._event_id == NUM_SHARED_BLOCK - 1:
        await loop.run_in_executor(None, self.bar.wait)
        await loop.run_in_executor(None, self.bar.wait)
    self._update_event_id()


async def _set_async(self):
    """`Notifier.set_async` with both of its barrier waits off the event loop's thread, one sender
    at a time: the engine's forward and output-prefetch tasks both send on the command channel,
    and a second sender reaching the barrier during the first's wait would count as a party."""
    from lmdeploy.pytorch.engine.executor.mp_executor import NUM_SHARED_BLOCK

    loop = asyncio.get_running_loop()
    async with self._dlinfer_send_lock:
        self.events[self._event_id].set()
        if self._event_id == NUM_SHARED_BLOCK - 1:
            await loop.run_in_executor(None, self.bar.wait)
            for event in self.events:
                event.clear()
            await loop.run_in_executor(None, self.bar.wait)
        self._update_event_id()


def unblock_notifier(notifier) -> None:
    """Make one LMDeploy `Notifier`'s async barrier waits leave its event loop running."""
    notifier.wait_async = types.MethodType(_wait_async, notifier)
    notifier.set_async = types.MethodType(_set_async, notifier)
    notifier._dlinfer_send_lock = asyncio.Lock()  # binds to the loop that first uses it


def rank_process(executor_proc, threads: int | None, **kwargs):
    """A rank's entry point: sets its threads (None: leave torch's), exits with the parent, and runs
    LMDeploy's `ExecutorProc._main_loop` (this module's import applied the adaptor's patches)."""
    from dlinfer.framework.lmdeploy_ext.patches.mp_engine import exit_with_parent

    if threads is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    from lmdeploy.pytorch.devices import DeviceContext, get_device_manager

    exit_with_parent()
    unblock_notifier(kwargs["comm_notifier"])
    unblock_notifier(kwargs["ret_notifier"])
    with get_device_manager().context(DeviceContext(kwargs["device_type"])):
        return executor_proc._main_loop(**kwargs)


def _patch_start(original):

    def start(self, **kwargs):
        spec = devices.spec_for(kwargs.get("device_type"))
        if spec is None:
            return original(self, **kwargs)
        assert self._proc is None
        dist_config = kwargs.get("dist_config")
        world_size = getattr(dist_config, "world_size", 1)
        threads = threads_per_rank(world_size) if spec.shares_host_cores else None
        self._proc = self.mp_ctx.Process(target=rank_process, args=(self, threads), kwargs=kwargs,
                                         name=f"ExecutorProc-{self.proc_id}", daemon=True)
        self._proc.start()
        self._dlinfer_device = spec.device_type

    return start


def _patch_join(original):

    def join(self):
        proc = self._proc
        if proc is None or getattr(self, "_dlinfer_device", None) is None:
            return original(self)
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            logger.warning("tensor-parallel rank %d (pid %s) did not end within %.0f s of SIGTERM: killing it.",
                           self.proc_id, proc.pid, JOIN_TIMEOUT_S)
            proc.kill()
            proc.join()

    return join


def end_ranks(procs, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Terminate the live processes of `procs` ((rank, Process) pairs); kill what is left after
    `timeout_s` seconds."""
    for _, proc in procs:
        if proc.is_alive():
            proc.terminate()
    for _, proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()


class RankFailedError(RuntimeError):
    """A tensor-parallel rank failed while the engine was being built; the engine's ranks are ended."""


def exit_code(proc, wait_s: float = EXIT_CODE_WAIT_S):
    """The exit code of `proc` (a multiprocessing.Process whose sentinel is ready), or None if it
    is not known within `wait_s`. Another thread may be joining the same process (the engine's
    release, a caller's `join`): whichever thread's `waitpid` reaps the child, the other's gets
    ECHILD and reads `exitcode` as None until the reaping thread has stored the code, so a None
    is read again until the deadline rather than taken as the answer."""
    deadline = time.monotonic() + wait_s
    proc.join(wait_s)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.exitcode


def watch_ranks(executor, exit_process=os._exit) -> threading.Thread:
    """Start a daemon thread that, when a rank process of `executor` (an MPExecutor) ends before
    the executor releases its ranks, logs it, ends the other ranks and calls `exit_process(1)`.
    A rank that signalled its failure (its SIGUSR1 seen within `SIGNAL_ARRIVAL_S` of its exit, or
    before it, for a rank ended by SIGKILL) gives a call waiting on it (`_patch_collective_rpc`)
    `SIGNAL_GRACE_S` to raise instead. The other ranks get `PEER_GONE_JOIN_S` between SIGTERM and
    SIGKILL when a rank has ended, `JOIN_TIMEOUT_S` when none has (a reported failure, stuck)."""
    procs = [(p.proc_id, p._proc) for p in executor.procs]

    def watch():
        sentinels = {proc.sentinel: (rank, proc) for rank, proc in procs}
        signalled_at = None
        while True:
            ended = wait(list(sentinels), timeout=0.5)
            if ended or executor._dlinfer_releasing.is_set():
                break
            if executor._dlinfer_rank_signalled.is_set():
                signalled_at = signalled_at or time.monotonic()
                if time.monotonic() - signalled_at > STUCK_AFTER_SIGNAL_S:
                    break
        if executor._dlinfer_releasing.is_set():
            return
        if not ended:  # a rank reported its failure, but none has ended and no call has raised
            logger.error("a tensor-parallel rank reported a failure %.0f s ago, but no rank has ended and the "
                         "engine's call did not return: ending the engine's ranks and this process (status 1).",
                         STUCK_AFTER_SIGNAL_S)
            end_ranks(procs)
            exit_process(1)
            return
        rank, proc = sentinels[ended[0]]
        code = exit_code(proc)
        killed = code is not None and code < 0
        # A rank SIGKILLed from outside (kill -9, the OOM killer) never reported a failure: no
        # SIGUSR1 to wait for (one already seen makes the wait return at once). Other signals keep the
        # wait: a rank that reported its failure can still die of SIGABRT or SIGSEGV in its clean-up.
        if executor._dlinfer_rank_signalled.wait(0 if code == -signal.SIGKILL else SIGNAL_ARRIVAL_S):
            executor._dlinfer_releasing.wait(SIGNAL_GRACE_S)
        if executor._dlinfer_releasing.is_set():
            return
        how = (f"was killed by signal {-code}" if killed else f"exited with code {code}" if code is not None
               else f"ended (its exit status was not read within {EXIT_CODE_WAIT_S:.0f} s)")
        logger.error("tensor-parallel rank %d (pid %s) %s: ending the engine's other ranks and this process "
                     "(status 1), as LMDeploy's MPExecutor does when a rank fails.", rank, proc.pid, how)
        end_ranks(procs, PEER_GONE_JOIN_S)
        exit_process(1)

    thread = threading.Thread(target=watch, name="dlinfer-watch-ranks", daemon=True)
    thread.start()
    return thread


def _patch_init(original):

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if devices.spec_for(kwargs.get("device_type")) is None:
            return
        unblock_notifier(self.comm_notifier)
        for ret_buf in self.ret_bufs:
            unblock_notifier(ret_buf.notifier)
        self._dlinfer_releasing = threading.Event()
        self._dlinfer_rank_signalled = threading.Event()

        def on_rank_signal(signum, frame):  # a rank's `_main_loop` failed and is about to exit
            self._dlinfer_rank_signalled.set()
            logger.error("a tensor-parallel rank reported a failure (SIGUSR1; its traceback is logged as "
                         "'Proc[rank] failed').")

        signal.signal(signal.SIGUSR1, on_rank_signal)
        watch_ranks(self)

    return __init__


def _patch_collective_rpc(original):

    def collective_rpc(self, method: str, *args, **kwargs):
        outputs = original(self, method, *args, **kwargs)
        signalled = getattr(self, "_dlinfer_rank_signalled", None)
        if signalled is not None and signalled.is_set():  # the replies were cut short by the failure
            self._dlinfer_releasing.set()
            end_ranks([(p.proc_id, p._proc) for p in self.procs])
            raise RankFailedError(f"a tensor-parallel rank failed in {method!r}: see the rank's traceback logged "
                                  "above ('Proc[rank] failed'); the engine's ranks are ended.")
        return outputs

    return collective_rpc


def _patch_release(original):

    def release(self):
        releasing = getattr(self, "_dlinfer_releasing", None)
        if releasing is not None:
            releasing.set()
        return original(self)

    return release


def apply() -> None:
    from lmdeploy.pytorch.engine.executor.mp_executor import ExecutorProc, MPExecutor

    wrap(ExecutorProc, "start", _patch_start)
    wrap(ExecutorProc, "join", _patch_join)
    wrap(MPExecutor, "__init__", _patch_init)
    wrap(MPExecutor, "release", _patch_release)
    wrap(MPExecutor, "collective_rpc", _patch_collective_rpc)
