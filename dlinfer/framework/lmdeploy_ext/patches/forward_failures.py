"""A forward step that raises fails its requests, not the engine (written against LMDeploy 0.18.0).

Why: the model agent runs each forward step in its background task
(`BaseModelAgent._async_loop_background` -> `_async_step`, engine/model_agent/agent.py). An
exception there ends that task; `wait_tasks` then fails, the engine loop stops, and every later
request gets 503 until a restart (under `serve`: the server exits with status 3, see
`mp_engine`). One request that reaches a bug in a model, a kernel or the engine's input code
thus ends the service for everyone.

How, for dlinfer's device types with one rank (LMDeploy's `UniExecutor`, the agent in the engine's
process and event loop):
1. Agent (`BaseModelAgent._async_step`): an exception is logged with its traceback and answered
   by a `FailedForward` output in place of the step's `BatchedOutputs`, so the engine loop, which
   awaits one output per step it sent, gets one. The agent then refuses every step it is given
   (one `FailedForward` each, nothing run) until the engine loop has reset it: the steps the loop
   sent ahead (its prefetch) were built from decode state the failure left undefined.
   If the step had already queued its output when it raised, no second output is queued.
2. Engine loop (`EngineLoop._finish_forward_output`): a `FailedForward` fails the step's
   requests: each gets LMDeploy's `INTERNAL_ENGINE_ERROR` with the exception's one-line text
   (the API server answers it as an error; a pipeline raises). `_prefetch_next_inputs` sends
   nothing more while a failure is pending.
3. Before the next step is scheduled (`EngineLoop._main_loop_try_send_next_inputs`, reached only
   once every step sent has been answered), the engine resets as LMDeploy's own sleep does,
   without moving memory: every request still in flight is failed the same way (the agent's
   decode state held theirs too), every scheduler session is ended (their KV blocks freed), the
   inputs maker's and the agent's runtime state are rebuilt, and the agent runs steps again.
   Requests that arrive later are served as before.

So a failing forward fails the requests in flight at that moment, each with an error naming the
exception, and the engine keeps serving. Not covered: exceptions in the engine loop's own code
(outside the forward), and tp > 1 (the ranks' agents run in other processes, where a failing
rank ends the engine, and `serve` exits with status 3, as before).

`DLINFER_FAIL_FORWARD_TOKEN` (a token id; tests only): a prefill step whose input ids contain it
raises inside the forward, so that tests can drive this path through a live server.
"""

from __future__ import annotations

import functools
import logging

from dlinfer import envs
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap

log = logging.getLogger("dlinfer.lmdeploy")

_FAILED_ATTR = "_dlinfer_failed_forward"   # on the agent: the pending failure's message, or absent
_PUSHED_ATTR = "_dlinfer_step_pushed"      # on the agent: whether the running step queued its output
_PENDING_ATTR = "_dlinfer_forward_failure"  # on the engine loop: the pending failure's message, or absent


class InjectedForwardFault(RuntimeError):
    """Raised inside a forward by `DLINFER_FAIL_FORWARD_TOKEN` (tests)."""


class FailedForward:
    """The output queued for a forward step that raised: no tokens, the failure's message.

    Stands where the engine loop expects a `BatchedOutputs` (model_agent.get_output_async calls
    `to_cpu` and sets `new_token_timestamp`; `_finish_forward_output` reads
    `kv_connector_output` and `next_token_ids` of other outputs, never of this one)."""

    kv_connector_output = None
    next_token_ids = None

    def __init__(self, message: str):
        self.message = message
        self.new_token_timestamp = None

    def to_cpu(self) -> "FailedForward":
        return self


def _message(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _agent_applies(agent) -> bool:
    """A dlinfer device type's agent, alone (one rank: the engine loop that reads its outputs can
    reset it)."""
    dist_config = getattr(agent, "dist_config", None)
    return (devices.spec_for(getattr(getattr(agent, "device_ctx", None), "device_type", None)) is not None
            and getattr(dist_config, "world_size", 1) == 1 and getattr(dist_config, "dp", 1) == 1)


def _injected_fault(inputs) -> bool:
    token = envs.get("DLINFER_FAIL_FORWARD_TOKEN")
    ids = getattr(inputs, "input_ids", None)
    return bool(token) and ids is not None and bool((ids == int(token)).any())


def _patch_push_output(original):

    @functools.wraps(original)
    def _push_output(self, output):
        self.__dict__[_PUSHED_ATTR] = True
        return original(self, output)

    return _push_output


def _patch_async_step(original):

    @functools.wraps(original)
    async def _async_step(self, *args, **kwargs):
        if not _agent_applies(self):
            return await original(self, *args, **kwargs)
        pending = self.__dict__.get(_FAILED_ATTR)
        if pending is not None:  # a step sent before the engine loop saw the failure: not run
            self._push_output(FailedForward(pending))
            return None
        self.__dict__[_PUSHED_ATTR] = False
        try:
            if _injected_fault(kwargs.get("inputs", args[0] if args else None)):
                raise InjectedForwardFault("forward failed on purpose (DLINFER_FAIL_FORWARD_TOKEN)")
            return await original(self, *args, **kwargs)
        except Exception as exc:  # asyncio.CancelledError is a BaseException: it still ends the task
            message = _message(exc)
            log.exception("dlinfer: a forward step raised (%s); its requests fail and the engine resets", message)
            self.__dict__[_FAILED_ATTR] = message
            if not self.__dict__.get(_PUSHED_ATTR):
                self._push_output(FailedForward(message))
            return None

    return _async_step


def _loop_applies(loop) -> bool:
    executor = getattr(loop, "executor", None)
    return (devices.spec_for(getattr(executor, "device_type", None)) is not None
            and hasattr(executor, "model_agent"))  # UniExecutor: the agent is in this process


def _fail(loop, resp, message: str) -> None:
    from lmdeploy.messages import ResponseType
    from lmdeploy.pytorch.engine.engine import response_reqs

    if resp is None or resp.is_done:
        return
    resp.is_done = True
    response_reqs(loop.req_manager, resp, ResponseType.INTERNAL_ENGINE_ERROR, err_msg=message)


def _patch_finish_forward_output(original):

    @functools.wraps(original)
    def _finish_forward_output(self, out, running, model_inputs, delta):
        if not isinstance(out, FailedForward):
            return original(self, out, running, model_inputs, delta)
        self.__dict__[_PENDING_ATTR] = out.message
        for seq in running or ():
            _fail(self, getattr(seq, "resp", None), f"the forward step of this request failed: {out.message}")
        return None

    return _finish_forward_output


def _patch_prefetch(original):

    @functools.wraps(original)
    async def _prefetch_next_inputs(self):
        if self.__dict__.get(_PENDING_ATTR) is not None:
            return None, None
        return await original(self)

    return _prefetch_next_inputs


def reset_after_failure(loop) -> int:
    """Fail every request in flight, end every scheduler session, rebuild the inputs maker's and
    the agent's runtime state, and let the agent run steps again; returns the sessions ended.
    Called when every step sent has been answered."""
    message = loop.__dict__.pop(_PENDING_ATTR)
    sessions = list(loop.scheduler.get_sessions())
    for session in sessions:
        for seq in list(session.sequences.values()):
            _fail(loop, getattr(seq, "resp", None),
                  f"the engine reset after a forward step of another request failed: {message}")
    for session in sessions:
        loop.scheduler.end_session(session.session_id)
    loop.reset_runtime_state()
    agent = loop.executor.model_agent
    agent.reset_runtime_state()
    agent.__dict__.pop(_FAILED_ATTR, None)
    log.warning("dlinfer: engine reset after a failed forward step (%s): %d session(s) ended", message,
                len(sessions))
    return len(sessions)


def _patch_try_send_next_inputs(original):

    @functools.wraps(original)
    async def _main_loop_try_send_next_inputs(self):
        if self.__dict__.get(_PENDING_ATTR) is not None and _loop_applies(self):
            reset_after_failure(self)
        return await original(self)

    return _main_loop_try_send_next_inputs


def apply() -> None:
    from lmdeploy.pytorch.engine.engine_loop import EngineLoop
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    wrap(BaseModelAgent, "_push_output", _patch_push_output)
    wrap(BaseModelAgent, "_async_step", _patch_async_step)
    wrap(EngineLoop, "_finish_forward_output", _patch_finish_forward_output)
    wrap(EngineLoop, "_prefetch_next_inputs", _patch_prefetch)
    wrap(EngineLoop, "_main_loop_try_send_next_inputs", _patch_try_send_next_inputs)
