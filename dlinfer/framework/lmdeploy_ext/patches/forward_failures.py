"""A forward step that raises fails its requests, not the engine (written against LMDeploy 0.18.0).

Why: the model agent runs each forward step in its background task
(`BaseModelAgent._async_loop_background` -> `_async_step`, engine/model_agent/agent.py). An
exception there ends that task; `wait_tasks` then fails, the engine loop stops, and every later
request gets 503 until a restart (under `serve`: the server exits with status 3, see
`mp_engine`). One request that reaches a bug in a model, a kernel or the engine's input code
thus ends the service for everyone.

How, for dlinfer's device types when the agent runs in the engine's own process and event loop
(LMDeploy's `UniExecutor`, which marks its agent; tp = 1 on the `mp` executor, and tp > 1, keep
LMDeploy's behaviour):
1. Agent (`BaseModelAgent._async_step`): an exception is logged with its traceback and, unless
   the step had already queued its output, answered by a `FailedForward` output in its place, so
   that the engine loop, which awaits one output per step it sent, gets one. The agent then
   refuses every step it is given (one `FailedForward` each, nothing run) until the engine loop
   has reset it: the steps the loop sent ahead (its prefetch) were built from decode state the
   failure left undefined.
2. Engine loop (`EngineLoop._finish_forward_output`): a `FailedForward` fails the step's
   requests: each gets LMDeploy's `INTERNAL_ENGINE_ERROR` (the API server's 500; a pipeline's
   finish reason "error"). After any output the loop also looks at the agent, which may have
   failed after queueing that output. `_prefetch_next_inputs` sends nothing more while a failure
   is pending.
3. Before the next step is scheduled (`EngineLoop._main_loop_try_send_next_inputs`, reached only
   once every step sent has been answered), the engine resets, as LMDeploy's own sleep does but
   without moving memory: every session with a sequence the engine had taken up (any status but
   waiting or stopped) is failed the same way and ended (the agent's decode state held those
   sequences too); the prefix cache drops every block only it holds (a failed prefill's blocks
   entered it when the step was scheduled, before their KV was written); the inputs maker's and
   the agent's runtime state are rebuilt; the agent runs steps again. Waiting requests, and idle
   sessions that keep their cache, are served as before.

So a failing forward fails the requests in flight at that moment, each with an error, and the
engine keeps serving. Not covered: exceptions in the engine loop's own code (outside the
forward), and agents in other processes (the `mp` executor, any tp > 1), where a failure still
ends the engine and `serve` exits with status 3.

`DLINFER_FAIL_FORWARD_TOKEN=<id>[:<where>]` (tests only): a step whose model inputs hold token
`id` (a prefill) raises: at its `start` (the default: no KV written), after the `model` ran (KV
written, no output), or after its `output` was queued.
"""

from __future__ import annotations

import functools
import logging

from dlinfer import envs
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap

log = logging.getLogger("dlinfer.lmdeploy")

_RECOVERS_ATTR = "_dlinfer_recovers"         # on an agent in the engine's process (UniExecutor): True
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
    """An agent that an engine loop in this process reads (marked by `UniExecutor.__init__`)."""
    return agent.__dict__.get(_RECOVERS_ATTR, False)


def _patch_uni_executor_init(original):

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if devices.spec_for(getattr(self, "device_type", None)) is not None:
            self.model_agent.__dict__[_RECOVERS_ATTR] = True

    return __init__


WHERE = ("start", "model", "output")


def injected_fault(inputs, where: str) -> bool:
    """Whether DLINFER_FAIL_FORWARD_TOKEN asks a step with model inputs `inputs` to fail at `where`."""
    value = envs.get("DLINFER_FAIL_FORWARD_TOKEN")
    if not value:
        return False
    token, _, at = value.partition(":")
    if not token.strip().isdigit() or (at or "start") not in WHERE:
        raise ValueError(f"DLINFER_FAIL_FORWARD_TOKEN must be <token id>[:{'|'.join(WHERE)}], got {value!r}")
    ids = getattr(inputs, "input_ids", None)
    return (at or "start") == where and ids is not None and bool((ids == int(token)).any())


def _fault(where: str) -> InjectedForwardFault:
    return InjectedForwardFault(f"forward failed on purpose at its {where} (DLINFER_FAIL_FORWARD_TOKEN)")


def _patch_push_output(original):

    @functools.wraps(original)
    def _push_output(self, output):
        result = original(self, output)
        self.__dict__[_PUSHED_ATTR] = True  # after: an output that failed to queue was not queued
        return result

    return _push_output


def _patch_model_forward(original):

    @functools.wraps(original)
    async def _async_model_forward(self, inputs, *args, **kwargs):
        result = await original(self, inputs, *args, **kwargs)
        if _agent_applies(self) and injected_fault(inputs, "model"):
            raise _fault("model")
        return result

    return _async_model_forward


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
        inputs = kwargs.get("inputs", args[0] if args else None)
        try:
            if injected_fault(inputs, "start"):
                raise _fault("start")
            result = await original(self, *args, **kwargs)
            if injected_fault(inputs, "output"):
                raise _fault("output")
            return result
        except Exception as exc:  # asyncio.CancelledError is a BaseException: it still ends the task
            message = _message(exc)
            log.exception("dlinfer: a forward step raised (%s); its requests fail and the engine resets", message)
            self.__dict__[_FAILED_ATTR] = message
            if not self.__dict__.get(_PUSHED_ATTR):
                self._push_output(FailedForward(message))
            return None

    return _async_step


def _loop_applies(loop) -> bool:
    """An engine loop whose agent is in this process and marked (`_agent_applies`)."""
    agent = getattr(getattr(loop, "executor", None), "model_agent", None)
    return agent is not None and _agent_applies(agent)


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
            result = original(self, out, running, model_inputs, delta)
            if out is not None and _loop_applies(self):  # the agent may have failed after queueing `out`
                failed = self.executor.model_agent.__dict__.get(_FAILED_ATTR)
                if failed is not None:
                    self.__dict__[_PENDING_ATTR] = failed
            return result
        if not _loop_applies(self):  # cannot happen (only marked agents answer so); never leave it pending
            raise RuntimeError(f"a forward step failed: {out.message}")
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


def _taken_up(session) -> bool:
    """Whether the engine had taken up a sequence of `session` (its decode state, its blocks)."""
    from lmdeploy.pytorch.messages import MessageStatus

    return any(seq.status not in (MessageStatus.WAITING, MessageStatus.STOPPED) for seq in session.sequences.values())


def reset_after_failure(loop) -> int:
    """Fail and end every session the engine had taken up, drop the prefix cache's own blocks,
    rebuild the inputs maker's and the agent's runtime state, and let the agent run steps again;
    returns the sessions ended. Called when every step sent has been answered."""
    message = loop.__dict__.pop(_PENDING_ATTR)
    scheduler = loop.scheduler
    ended = [session for session in list(scheduler.get_sessions()) if _taken_up(session)]
    for session in ended:
        for seq in list(session.sequences.values()):
            _fail(loop, getattr(seq, "resp", None),
                  f"the engine reset after a forward step failed: {message}")
    for session in ended:
        scheduler.end_session(session.session_id)
    trie = getattr(scheduler, "block_trie", None)
    if trie is not None and trie.enabled:  # a failed prefill's blocks entered it before their KV was written
        trie.evict(1 << 40)
    loop.reset_runtime_state()
    agent = loop.executor.model_agent
    agent.reset_runtime_state()
    agent.__dict__.pop(_FAILED_ATTR, None)
    loop.has_runable_event.set()
    log.warning("dlinfer: engine reset after a failed forward step (%s): %d session(s) ended", message, len(ended))
    return len(ended)


def _patch_try_send_next_inputs(original):

    @functools.wraps(original)
    async def _main_loop_try_send_next_inputs(self):
        if self.__dict__.get(_PENDING_ATTR) is not None and _loop_applies(self):
            reset_after_failure(self)
        return await original(self)

    return _main_loop_try_send_next_inputs


def apply() -> None:
    from lmdeploy.pytorch.engine.engine_loop import EngineLoop
    from lmdeploy.pytorch.engine.executor.uni_executor import UniExecutor
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    wrap(UniExecutor, "__init__", _patch_uni_executor_init)
    wrap(BaseModelAgent, "_push_output", _patch_push_output)
    wrap(BaseModelAgent, "_async_model_forward", _patch_model_forward)
    wrap(BaseModelAgent, "_async_step", _patch_async_step)
    wrap(EngineLoop, "_finish_forward_output", _patch_finish_forward_output)
    wrap(EngineLoop, "_prefetch_next_inputs", _patch_prefetch)
    wrap(EngineLoop, "_main_loop_try_send_next_inputs", _patch_try_send_next_inputs)
