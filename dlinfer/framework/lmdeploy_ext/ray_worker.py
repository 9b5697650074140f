"""The Ray actor of one tensor-parallel rank on a dlinfer device type (patches/ray_executor.py).

Ray pickles an actor class by module and name, so a worker process imports this module to build
the actor, and importing it imports the adaptor package first: every patch is applied in the
worker before LMDeploy builds anything there (as `mp_executor.rank_process` does for the mp
executor's ranks). This module imports Ray and LMDeploy's Ray executor, so only the Ray path
imports it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import pickle

import torch
from lmdeploy.pytorch.devices import DeviceContext, get_device_manager
from lmdeploy.pytorch.engine.executor.ray_executor import RayWorkerWrapper

from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.ray_steps import ERROR, INPUTS, OUTPUT, TOKEN, read_frame, read_header, write_frame

logger = logging.getLogger("dlinfer.ray")
# Seconds: for a connection's token, and for a drained ERROR frame; for the served connection to end.
TOKEN_TIMEOUT_S = 10.0
STEP_CLOSE_TIMEOUT_S = 10.0


def take_niceness(niceness: int) -> bool:
    """Give every thread of this process `niceness` (Linux keeps it per thread; threads started
    later inherit their creator's). Why: Ray starts its workers at niceness 15 (its
    `worker_niceness`), so that its own daemons come first; a tensor-parallel rank meets its peers
    in an all-reduce every layer, so at 15 any busy process at 0 (the engine's own loop among them)
    delays every rank of the step: measured at the 1B shape on two cores, 0.93x the mp executor,
    whose ranks run at the engine's niceness, against 0.98x with the workers at 0. Lowering a
    niceness needs the privilege to (root, CAP_SYS_NICE or RLIMIT_NICE); without it the rank stays
    where Ray put it, says so, and names Ray's setting that avoids it. True if every thread has it."""
    if not os.path.isdir("/proc/self/task") or os.getpriority(os.PRIO_PROCESS, 0) == niceness:
        return True
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            logger.warning("this tensor-parallel rank runs at Ray's worker niceness %d, not the engine's %d (no "
                           "permission to change it): start the Ray cluster with RAY_worker_niceness=%d",
                           os.getpriority(os.PRIO_PROCESS, 0), niceness, niceness)
            return False
    return True


class DlinferRayWorker(RayWorkerWrapper):
    """LMDeploy's `RayWorkerWrapper` for a dlinfer device type: the process serves that device type
    for its life (its device context set once: LMDeploy's process-group start reads the current
    one), at the engine's `niceness` (`take_niceness`), with `threads` compute threads, warms its
    collectives up on the device's torch device instead of "cuda", and takes its steps from the
    driver's connection (`open_step_channel`, ray_steps.py) where the executor uses one."""

    def __init__(self, *args, threads: int | None = None, niceness: int | None = None, **kwargs):
        device_type = kwargs.get("device_type")
        if devices.spec_for(device_type) is None:
            raise ValueError(f"DlinferRayWorker serves dlinfer's device types, got {device_type!r}")
        if niceness is not None:
            take_niceness(niceness)
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        get_device_manager().set_context(DeviceContext(device_type))
        super().__init__(*args, **kwargs)
        self._step_server: asyncio.AbstractServer | None = None
        self._step_task: asyncio.Task | None = None  # the connection being served

    def warmup_dist(self):
        from lmdeploy.pytorch.distributed import all_reduce, get_dist_manager

        spec = devices.spec_for(self.device_type)
        with get_dist_manager().context(self.dist_ctx):
            all_reduce(torch.zeros(1, device=spec.torch_device), group=self.dist_ctx.tp_group.gpu_group)

    def get_pid(self) -> int:
        return os.getpid()

    async def open_step_channel(self, token: bytes) -> tuple[str, int]:
        """Listen on this node's address for the driver's one step connection, which must open
        with `token`; returns (host, port). Runs on the actor's event loop, the model agent's. A
        connection served before is closed first (`close_step_channel`)."""
        await self.close_step_channel()
        self._step_server = await asyncio.start_server(functools.partial(self._serve_steps, token),
                                                       host=self.node_ip, port=0)
        host, port = self._step_server.sockets[0].getsockname()[:2]
        return host, port

    async def close_step_channel(self) -> None:
        """Stop serving steps: the listener, the connection, and the output sender with the output
        it holds, if any (dropped, as LMDeploy's sleep drains the agent's queues)."""
        server, task = self._step_server, self._step_task
        self._step_server = self._step_task = None
        if server is not None:
            server.close()
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=STEP_CLOSE_TIMEOUT_S)

    async def _read_token(self, token: bytes, reader: asyncio.StreamReader) -> bool:
        """Whether the connection opens with `token`: its frame header first, so that nothing but a
        token-sized payload is read from a peer that has not shown it, within TOKEN_TIMEOUT_S."""
        try:
            kind, size = await asyncio.wait_for(read_header(reader), TOKEN_TIMEOUT_S)
            if kind != TOKEN or size != len(token):
                return False
            payload = await asyncio.wait_for(reader.readexactly(size), TOKEN_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False
        return hmac.compare_digest(payload, token)

    async def _serve_steps(self, token: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """One connection: each INPUTS frame goes to the model agent; where this rank produces
        outputs, `_send_outputs` answers each step in order. Anything else that goes wrong here is
        answered by an ERROR frame naming it. Ends with the connection."""
        if self._step_task is not None or not await self._read_token(token, reader):
            logger.error("rank %s: a step connection without this driver's token, or a second one, was refused",
                         self.rank)
            writer.close()
            return
        self._step_task = asyncio.current_task()
        self._step_server.close()  # one driver, one connection
        owed: asyncio.Queue = asyncio.Queue()
        sender = None
        try:
            agent = self.model_agent
            if agent.need_output:
                sender = asyncio.ensure_future(self._send_outputs(owed, writer))
            while True:
                kind, payload = await read_frame(reader)
                if kind != INPUTS:
                    raise ValueError(f"unexpected frame {kind!r} on the step connection")
                agent.set_forward_inputs(pickle.loads(payload))
                if sender is not None:
                    owed.put_nowait(None)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the driver closed the connection: the engine stops or sleeps
        except Exception as error:  # a bad frame, inputs that do not unpickle, the agent refusing them
            logger.exception("rank %s: the step connection failed", self.rank)
            write_frame(writer, ERROR, f"tp rank {self.rank}: its step connection failed: {error!r}".encode())
        finally:
            if sender is not None:
                sender.cancel()
            writer.close()
            if self._step_task is asyncio.current_task():
                self._step_task = None

    async def _send_outputs(self, owed: asyncio.Queue, writer: asyncio.StreamWriter):
        """For each step sent: its output packed and pickled in an OUTPUT frame, or an ERROR frame
        if the model agent's loop ends first (a failed forward, a peer gone from the all-reduce) or
        the output cannot be made or sent, after which the connection closes: no step waits for an
        output that cannot come."""
        from ray import cloudpickle

        agent = self.model_agent
        output = None
        try:
            while True:
                await owed.get()
                output = asyncio.ensure_future(self.get_outputs())
                loops = [task for task in (agent._background_task, agent._preprocess_task) if task is not None]
                done, _ = await asyncio.wait([output, *loops], return_when=asyncio.FIRST_COMPLETED)
                if output not in done:
                    ended = next(iter(done))
                    error = ended.exception() if not ended.cancelled() else asyncio.CancelledError()
                    raise RuntimeError(f"the model agent's {ended.get_name()} loop ended before the step's output: "
                                       f"{error!r}")
                packed, output = output.result(), None
                write_frame(writer, OUTPUT, cloudpickle.dumps(packed))
                await writer.drain()
        except Exception as error:
            logger.error("rank %s: a step's output failed: %r", self.rank, error)
            write_frame(writer, ERROR, f"tp rank {self.rank}: {error}".encode(errors="replace"))
            try:
                await asyncio.wait_for(writer.drain(), TOKEN_TIMEOUT_S)
            except Exception:  # the driver is gone too
                pass
        finally:
            if output is not None:
                output.cancel()
            writer.close()
