"""LMDeploy's multi-process engine on dlinfer's device types (written against LMDeploy 0.18.0).

Why: with `enable_mp_engine=True`, which `lmdeploy serve api_server` forces
(serve/openai/api_server.py), the engine runs in a child process that
`ZMQMPEngine._start_mp_proc` (pytorch/engine/mp_engine/zmq_engine.py) starts with
multiprocessing *spawn*: a fresh interpreter that imports the parent's main module (as
`__mp_main__`) and what unpickling the process object needs, LMDeploy's `ZMQMPEngine._mp_proc`
and the engine config. Three things go wrong there:
1. Unless the main module happens to import dlinfer, the child has none of the adaptor's
   patches: its `Engine` refuses device_type="cpu".
2. If the server process is killed (SIGKILL, the OOM killer), the child, which holds the weights
   and the whole KV cache in RAM, lives on: only a clean shutdown terminates it.
3. The child publishes its RPC port under a `multiprocessing.Manager` condition
   (`ZMQMPEngine._mp_proc`); the parent sees the port once the child's `release` has reached the
   manager and then shuts the manager down (leaving `with mp.Manager()`), which can happen before
   the manager's reply to that `release` reaches the child: the child dies of EOFError and the
   server with "engine process is not alive". Seen in 2 of 8 server starts on a busy 2-core
   machine.

How: `ZMQMPEngine._mp_proc`, the child's target (a staticmethod), is replaced by
`engine_process`, a module-level function of this module. Spawn pickles a function by module
and name, so the child imports this module to find its target, and importing it imports the
adaptor package first, which applies every patch in the child before anything is built (1; no
main module, environment variable or import hook involved). `engine_process` then
- watches the parent (`multiprocessing.parent_process()`'s sentinel): when the parent is gone
  it sends its own process SIGTERM (LMDeploy's handler closes the engine) and exits for good
  `ORPHAN_GRACE_S` seconds later (2);
- hands LMDeploy's `_mp_proc` the port condition wrapped so that losing the manager while
  releasing it is not an error: the release already took effect (the parent could not have
  seen the port otherwise) (3);
- runs LMDeploy's `_mp_proc` unchanged.
For LMDeploy's own device types the child gets the same patches (inert there) its parent had.

4. The reverse: when the engine process dies (killed, OOM-killed, a crash), LMDeploy's RPC client
   marks the backend dead (`ZMQMPEngine._mark_backend_dead`, called by the client's sentinel
   watch) and the API server goes on answering 5xx forever, so a supervisor that restarts on
   exit (systemd, Docker, Kubernetes) never fires. `python -m dlinfer serve` sets
   `exit_on_engine_death(True)` for its process: the wrapped `_mark_backend_dead` then logs one
   line with the engine's exit code and ends the server with status `ENGINE_DIED_STATUS` half a
   second later. A `close()` in progress (a clean shutdown, which stops the engine itself) turns
   it off. Pipelines in a user's own process are never exited this way: only `serve` asks.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
import threading

from dlinfer.framework.lmdeploy_ext.patching import original_of, wrap

# Seconds an orphaned engine process gets to close after its own SIGTERM before it exits anyway.
ORPHAN_GRACE_S = 10.0
# The server's exit status when its engine process died (4 above).
ENGINE_DIED_STATUS = 3
_exit_on_death = threading.Event()  # set by `exit_on_engine_death(True)`: the serve command's process


def exit_on_engine_death(enabled: bool) -> None:
    """Whether this process exits (status ENGINE_DIED_STATUS) when its multi-process engine dies."""
    (_exit_on_death.set if enabled else _exit_on_death.clear)()


def engine_process(shared_dict, condition, *args, **kwargs):
    """The engine process's entry point: LMDeploy's `ZMQMPEngine._mp_proc`, in a process that has
    imported the adaptor (this module's import did) and exits with its parent."""
    from lmdeploy.pytorch.engine.mp_engine.zmq_engine import ZMQMPEngine

    exit_with_parent()
    mp_proc = original_of(ZMQMPEngine.__dict__["_mp_proc"]).__func__
    return mp_proc(shared_dict, PortHandOff(condition), *args, **kwargs)


class PortHandOff:
    """LMDeploy's port hand-off condition (a Manager proxy) whose release survives the manager's
    shutdown (see this module's doc, 3); everything else is the proxy's."""

    def __init__(self, condition):
        self._condition = condition

    def __enter__(self):
        return self._condition.__enter__()

    def __exit__(self, *exc_info):
        try:
            return self._condition.__exit__(*exc_info)
        except (EOFError, ConnectionError):  # the manager shut down after the release took effect
            return False

    def __getattr__(self, name):
        return getattr(self._condition, name)


def exit_with_parent(grace_s: float = ORPHAN_GRACE_S) -> bool:
    """In a multiprocessing child: once the parent is gone, SIGTERM this process, and exit it
    `grace_s` seconds later if it is still running. False (nothing done) outside such a child."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return False

    def watch():
        parent.join()  # returns when the parent's end of the sentinel pipe closes: the parent exited
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="dlinfer-exit-with-parent", daemon=True).start()
    return True


def _patch_mp_proc(original):
    return staticmethod(engine_process)


def _patch_mark_backend_dead(original):

    @functools.wraps(original)
    def _mark_backend_dead(self):
        original(self)
        if not _exit_on_death.is_set() or getattr(self, "_dlinfer_closing", False):
            return
        proc = getattr(self, "proc", None)
        code = getattr(proc, "exitcode", None)
        print(f"[dlinfer] the engine process (pid {getattr(proc, 'pid', '?')}) died (exit code {code}); the "
              f"server exits with status {ENGINE_DIED_STATUS} so that its supervisor can restart it",
              file=sys.stderr, flush=True)
        threading.Timer(0.5, os._exit, (ENGINE_DIED_STATUS,)).start()

    return _mark_backend_dead


def _patch_close(original):

    @functools.wraps(original)
    def close(self):
        self._dlinfer_closing = True  # the engine is stopped on purpose: not a death
        return original(self)

    return close


def apply() -> None:
    from lmdeploy.pytorch.engine.mp_engine.zmq_engine import ZMQMPEngine

    wrap(ZMQMPEngine, "_mp_proc", _patch_mp_proc)
    wrap(ZMQMPEngine, "_mark_backend_dead", _patch_mark_backend_dead)
    wrap(ZMQMPEngine, "close", _patch_close)
