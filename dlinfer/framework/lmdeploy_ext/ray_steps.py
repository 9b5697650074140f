"""A step's inputs and outputs between LMDeploy's Ray executor and its ranks over one TCP connection
per rank, for dlinfer device types (patches/ray_executor.py; written against LMDeploy 0.18.0 and
Ray 2.60). Ray still places, starts, watches and stops the ranks, and carries every other call.

Why: LMDeploy's `RayExecutor.forward_async` puts a step's inputs into Ray's object store and calls
each rank's `forward_async` with the reference, and `get_output_async` calls the first rank's
`get_outputs`: one put and tp + 1 actor calls a step, 4.5-7 ms a step on the 2-vCPU machines this
project measures on (`benchmarks/tp_executors.py --side ray-costs`: a put 0.6 ms, a call's round
trip 2.5 ms), which a small model's step cannot hide. A Ray compiled graph removes those calls, but
its readers wait by spinning on `sched_yield`: the driver's reader took a whole core for the length
of every step (and, with asyncio, for as long as the engine was idle), which halved a 1B model's
decode on two cores. A socket costs neither: a step's inputs are pickled once and written to each
rank's connection, the ranks read them on their own event loop, and the first rank writes each
step's output back; every wait is the event loop's (epoll), so an idle engine costs nothing.

The protocol (`write_frame` / `read_frame`): frames of a kind byte, an 8-byte length and a payload.
The driver opens each connection with a `TOKEN` frame (random bytes it gave the rank through Ray, so
that the rank serves only its own driver), then sends an `INPUTS` frame a step; the rank that
produces outputs answers each step, in order, with an `OUTPUT` frame (the packed output, pickled:
nothing the engine keeps is a view of a buffer) or, if its model agent's loop ended first, an
`ERROR` frame (the reason, UTF-8), and closes. The rank's side is `ray_worker.DlinferRayWorker`.

`wanted(executor)` says whether an executor uses it: a dlinfer device type, dp = 1, no KV transfer
(its connector steps gather outputs from every rank), and DLINFER_RAY_STEP_CHANNEL not 0.
Otherwise LMDeploy's own forward and output calls run, on the same actors.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import struct

from dlinfer import envs
from dlinfer.framework.lmdeploy_ext import devices

logger = logging.getLogger("dlinfer.ray")

TOKEN, INPUTS, OUTPUT, ERROR = b"T", b"I", b"O", b"E"
_HEADER = struct.Struct("!cQ")  # kind, payload length
# Seconds: to connect to a rank once it listens; for each rank's liveness answer after a failure.
CONNECT_TIMEOUT_S = 30.0
LIVENESS_TIMEOUT_S = 10.0


def write_frame(writer: asyncio.StreamWriter, kind: bytes, payload: bytes) -> None:
    writer.write(_HEADER.pack(kind, len(payload)) + payload)


async def read_header(reader: asyncio.StreamReader) -> tuple[bytes, int]:
    """(kind, payload size); asyncio.IncompleteReadError at the end of the stream."""
    return _HEADER.unpack(await reader.readexactly(_HEADER.size))


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(kind, payload); asyncio.IncompleteReadError at the end of the stream."""
    kind, size = await read_header(reader)
    return kind, await reader.readexactly(size)


def wanted(executor) -> bool:
    """Whether `executor` (LMDeploy's RayExecutor) sends its steps through `StepChannels`."""
    choice = envs.get("DLINFER_RAY_STEP_CHANNEL") or "1"
    if choice not in ("0", "1"):
        raise ValueError(f"DLINFER_RAY_STEP_CHANNEL must be 0 or 1, got {choice!r}")
    if choice == "0":
        return False
    if devices.spec_for(executor.device_type) is None or executor.dp != 1:
        return False
    transfer = getattr(executor.cache_config, "kv_transfer_config", None)
    return transfer is None or not transfer.is_kv_transfer_instance


async def first_dead_rank(workers: list) -> Exception | None:
    """Ray's error (ActorDiedError, which names the actor) for the first of `workers` that no longer
    answers a call, or None if each answers (or is too busy to, within LIVENESS_TIMEOUT_S)."""
    import ray

    for worker in workers:
        try:
            await asyncio.wait_for(worker.get_pid.remote(), LIVENESS_TIMEOUT_S)
        except ray.exceptions.RayActorError as died:
            logger.error("a tensor-parallel rank is gone: %s", died)
            return died
        except asyncio.TimeoutError:
            continue
    return None


class RankFailed(RuntimeError):
    """A rank's step ended in an error (its ERROR frame) or its connection ended."""


class StepChannels:
    """The connections from one executor to its workers (module docstring); `workers[0]` is the
    rank that produces outputs (LMDeploy's rank order). Used from the engine's event loop, but for
    `close`. `reset` (LMDeploy's sleep) drops the connections and any output sent on them; the next
    step connects again. `close` (the engine's stop) is final."""

    def __init__(self, workers: list):
        self.workers = list(workers)
        self._writers: list[asyncio.StreamWriter] = []
        self._leader: asyncio.StreamReader | None = None
        self._ended: list[asyncio.Task] = []  # one per other rank: done when its connection ends
        self._owed = 0  # steps sent whose output has not been read
        self._loop: asyncio.AbstractEventLoop | None = None  # the engine's, where the connections live
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("dlinfer's Ray step connections are closed: the engine has stopped")

    async def _connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        token = secrets.token_bytes(16)
        addresses = await asyncio.gather(*(worker.open_step_channel.remote(token) for worker in self.workers))
        readers, writers = [], []
        try:
            for host, port in addresses:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
                write_frame(writer, TOKEN, token)
                readers.append(reader)
                writers.append(writer)
        except BaseException:
            for writer in writers:
                writer.close()
            raise
        self._writers, self._leader = writers, readers[0]
        self._ended = [asyncio.ensure_future(reader.read()) for reader in readers[1:]]  # b"" at the end

    async def submit(self, inputs: dict) -> None:
        """Send one step's inputs to every rank."""
        self._check_open()
        if inputs.get("kv_connector_metadata") is not None:
            raise RuntimeError("a KV-connector step reached dlinfer's Ray step channel, which reads one rank's output")
        from ray import cloudpickle

        try:
            if not self._writers:
                await self._connect()
            payload = cloudpickle.dumps(inputs)
            for writer in self._writers:
                write_frame(writer, INPUTS, payload)
            await asyncio.gather(*(writer.drain() for writer in self._writers))
        except Exception as error:
            raise await self._failure(error) from error
        self._owed += 1

    async def next_output(self):
        """The oldest step's output from the first rank (as LMDeploy's worker packs it)."""
        self._check_open()
        if self._owed == 0:
            raise RuntimeError("dlinfer's Ray step channel: an output was asked for before its step was sent")
        self._owed -= 1
        frame = asyncio.ensure_future(read_frame(self._leader))
        try:
            await asyncio.wait([frame, *self._ended], return_when=asyncio.FIRST_COMPLETED)
            self._check_open()  # closed meanwhile: not a rank's failure
            if not frame.done():
                raise RankFailed("a tensor-parallel rank's step connection ended")
            kind, payload = frame.result()
            if kind == ERROR:
                raise RankFailed(payload.decode(errors="replace"))
            if kind != OUTPUT:
                raise RankFailed(f"unexpected frame {kind!r} from the first rank")
        except RankFailed as error:
            raise await self._failure(error) from error
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            raise await self._failure(RankFailed(f"the first rank's step connection ended: {error!r}")) from error
        finally:
            if not frame.done():
                frame.cancel()
        return pickle.loads(payload)

    async def _failure(self, error: Exception) -> Exception:
        """The error to raise for a failed step: Ray's error for the first rank that is gone (it
        names the actor), else `error`."""
        return await first_dead_rank(self.workers) or error

    async def reset(self) -> None:
        """Drop the connections, and any output sent on them that was not read (LMDeploy's sleep
        drops the step it sent ahead): each rank stops serving, and the next step connects again."""
        self._drop()
        if self.workers:
            await asyncio.wait([asyncio.ensure_future(worker.close_step_channel.remote()) for worker in self.workers],
                               timeout=LIVENESS_TIMEOUT_S)

    def close(self) -> None:
        """Close the connections for good (idempotent; from any thread): each rank's reader sees
        the end and stops; a later step raises."""
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        tasks, writers = self._ended, self._writers
        self._writers, self._ended, self._leader, self._owed = [], [], None, 0
        if not writers:
            return

        def close_all():
            for task in tasks:
                task.cancel()
            for writer in writers:
                writer.close()

        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop.is_closed():  # the engine's loop is gone, and its sockets with it
            return
        if running is loop:
            close_all()
        else:
            loop.call_soon_threadsafe(close_all)
