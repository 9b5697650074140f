"""The step connections between LMDeploy's Ray executor and its ranks (ray_steps.py, and the rank's
side in ray_worker.py), without a Ray cluster: the rank's server and the driver's `StepChannels`
talk over 127.0.0.1 as in an engine, with stand-ins for the Ray actor handles and the model agent."""

from __future__ import annotations

import asyncio
import pickle
import time
import types

import pytest

ray = pytest.importorskip("ray")

from dlinfer.framework.lmdeploy_ext import ray_steps  # noqa: E402
from dlinfer.framework.lmdeploy_ext.ray_worker import DlinferRayWorker  # noqa: E402


class _Output:
    def __init__(self, token):
        self.token = token

    def to_numpy(self):  # LMDeploy's RayWorkerWrapper.pack_output packs with it
        if self.token == "unpackable":
            raise TypeError("cannot pack this output")
        return {"next_token_ids": [self.token]}


class _Agent:
    """The model agent's surface the rank's step server uses: a step's output is its inputs' token,
    or the agent's loop fails at the step whose inputs say "fail"."""

    def __init__(self, need_output: bool):
        self.need_output = need_output
        self.inputs = []
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._failure = asyncio.get_running_loop().create_future()
        self._preprocess_task = None
        self._background_task = asyncio.ensure_future(self._loop(), loop=asyncio.get_running_loop())
        self._background_task.set_name("ModelAgentLoop")

    async def _loop(self):
        raise await self._failure

    def set_forward_inputs(self, inputs):
        self.inputs.append(inputs)
        if inputs.get("fail"):
            self._failure.set_result(ConnectionError("gloo: connection closed by peer"))
        elif self.need_output and not inputs.get("hold"):  # hold: as a rank waiting in its all-reduce
            self._outputs.put_nowait(_Output(inputs["token"]))

    async def get_output_async(self):
        return await self._outputs.get()


class _Call:
    def __init__(self, function):
        self._function = function

    def remote(self, *args):
        return asyncio.ensure_future(self._function(*args))


class _Handle:
    """What StepChannels uses of a Ray actor handle: `.open_step_channel.remote`, `.get_pid.remote`."""

    def __init__(self, rank: int, need_output: bool):
        worker = object.__new__(DlinferRayWorker)  # LMDeploy's constructor loads a model
        worker.rank, worker.node_ip, worker._step_server, worker._step_task = rank, "127.0.0.1", None, None
        worker.model_agent = _Agent(need_output)
        self.worker, self.dead = worker, False

        async def get_pid():
            if self.dead:
                raise ray.exceptions.ActorDiedError()
            return rank

        async def open_step_channel(token):
            return await worker.open_step_channel(token)

        async def close_step_channel():
            return await worker.close_step_channel()

        self.get_pid, self.open_step_channel = _Call(get_pid), _Call(open_step_channel)
        self.close_step_channel = _Call(close_step_channel)


def _ranks():
    return [_Handle(0, need_output=True), _Handle(1, need_output=False)]


def _stop(ranks):
    for rank in ranks:
        loop = rank.worker.model_agent._background_task
        if loop.done():
            loop.exception()  # retrieved: the failure it raised is this test's
        else:
            loop.cancel()


def test_steps_reach_every_rank_and_the_outputs_come_back_in_order():
    async def run():
        ranks = _ranks()
        channels = ray_steps.StepChannels(ranks)
        await channels.submit({"token": 5})
        await channels.submit({"token": 6})  # LMDeploy sends the next step before reading the last output
        outputs = [await asyncio.wait_for(channels.next_output(), 10) for _ in range(2)]
        await channels.submit({"token": 7})
        outputs.append(await asyncio.wait_for(channels.next_output(), 10))
        for rank in ranks:
            assert rank.worker.model_agent.inputs == [{"token": 5}, {"token": 6}, {"token": 7}]
        channels.close()
        await asyncio.sleep(0.05)
        _stop(ranks)
        return outputs

    assert asyncio.run(run()) == [{"next_token_ids": [5]}, {"next_token_ids": [6]}, {"next_token_ids": [7]}]


def test_a_step_whose_agent_loop_ends_raises_its_reason_instead_of_waiting():
    async def run():
        ranks = _ranks()
        channels = ray_steps.StepChannels(ranks)
        await channels.submit({"token": 1})
        assert await channels.next_output() == {"next_token_ids": [1]}
        await channels.submit({"fail": True})
        start = time.monotonic()
        with pytest.raises(ray_steps.RankFailed, match=r"tp rank 0: .*ModelAgentLoop loop ended.*gloo"):
            await asyncio.wait_for(channels.next_output(), 10)
        assert time.monotonic() - start < 5
        channels.close()
        _stop(ranks)

    asyncio.run(run())


def test_after_a_reset_an_output_sent_for_a_dropped_step_is_not_read():
    """LMDeploy's sleep drops the step it sent ahead; the rank may have sent that step's output
    already. After `reset` the next step connects again and reads its own output."""
    async def run():
        ranks = _ranks()
        channels = ray_steps.StepChannels(ranks)
        await channels.submit({"token": 1})
        await channels.submit({"token": 2})  # sent ahead, then dropped
        assert await channels.next_output() == {"next_token_ids": [1]}
        await asyncio.sleep(0.1)  # the rank has sent step 2's output by now
        await channels.reset()
        await channels.submit({"token": 3})
        output = await asyncio.wait_for(channels.next_output(), 10)
        channels.close()
        with pytest.raises(RuntimeError, match="closed: the engine has stopped"):
            await channels.submit({"token": 4})
        await asyncio.sleep(0.05)
        _stop(ranks)
        return output

    assert asyncio.run(run()) == {"next_token_ids": [3]}


def test_an_output_that_cannot_be_sent_is_answered_by_its_reason():
    async def run():
        ranks = _ranks()
        channels = ray_steps.StepChannels(ranks)
        await channels.submit({"token": "unpackable"})
        with pytest.raises(ray_steps.RankFailed, match="tp rank 0: cannot pack this output"):
            await asyncio.wait_for(channels.next_output(), 10)
        channels.close()
        await asyncio.sleep(0.05)
        _stop(ranks)

    asyncio.run(run())


def test_a_dead_rank_is_named_by_rays_error():
    """A rank's connection ends (its process died): the step fails with Ray's ActorDiedError for it,
    found by asking each rank for its pid."""
    async def run():
        ranks = _ranks()
        channels = ray_steps.StepChannels(ranks)
        await channels.submit({"token": 1})
        assert await channels.next_output() == {"next_token_ids": [1]}
        ranks[1].dead = True
        ranks[1].worker._step_server.close()
        await channels.submit({"token": 2, "hold": True})
        channels._writers[1].transport.abort()  # as the kernel does for a killed process's socket
        with pytest.raises(ray.exceptions.ActorDiedError):
            await asyncio.wait_for(channels.next_output(), 10)
        channels.close()
        _stop(ranks)

    asyncio.run(run())


def test_a_connection_without_the_token_is_refused():
    async def run():
        rank = _Handle(0, need_output=True)
        host, port = await rank.worker.open_step_channel(b"right token")
        reader, writer = await asyncio.open_connection(host, port)
        ray_steps.write_frame(writer, ray_steps.TOKEN, b"wrong token")
        ray_steps.write_frame(writer, ray_steps.INPUTS, pickle.dumps({"token": 1}))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing served
        assert rank.worker.model_agent.inputs == []
        writer.close()
        rank.worker._step_server.close()
        _stop([rank])

    asyncio.run(run())


def test_a_first_frame_that_is_not_a_token_sized_token_is_not_read():
    """A peer that announces a huge first frame is closed at once, its payload never read."""
    async def run():
        rank = _Handle(0, need_output=True)
        host, port = await rank.worker.open_step_channel(b"t" * 16)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(ray_steps._HEADER.pack(ray_steps.TOKEN, 1 << 40))  # and then nothing
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        rank.worker._step_server.close()
        _stop([rank])

    asyncio.run(run())


def _executor(device_type="cpu", dp=1, transfer=False):
    config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(is_kv_transfer_instance=transfer))
    return types.SimpleNamespace(device_type=device_type, dp=dp, cache_config=config)


def test_which_executors_use_the_step_connections(monkeypatch):
    monkeypatch.delenv("DLINFER_RAY_STEP_CHANNEL", raising=False)
    assert ray_steps.wanted(_executor())
    assert not ray_steps.wanted(_executor(device_type="cuda"))  # LMDeploy's own devices: its own path
    assert not ray_steps.wanted(_executor(dp=2))
    assert not ray_steps.wanted(_executor(transfer=True))  # connector steps gather every rank's output
    monkeypatch.setenv("DLINFER_RAY_STEP_CHANNEL", "0")
    assert not ray_steps.wanted(_executor())
    monkeypatch.setenv("DLINFER_RAY_STEP_CHANNEL", "yes")
    with pytest.raises(ValueError, match="DLINFER_RAY_STEP_CHANNEL must be 0 or 1, got 'yes'"):
        ray_steps.wanted(_executor())


def test_a_connector_step_is_refused_before_anything_is_sent():
    channels = ray_steps.StepChannels(workers=[])
    with pytest.raises(RuntimeError, match="KV-connector step"):
        asyncio.run(channels.submit({"kv_connector_metadata": object()}))
    assert channels._writers == []
