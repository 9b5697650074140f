"""A stand-in for `torch.cuda` that LMDeploy's engine modules see on a machine without CUDA.

LMDeploy 0.18's model agent and cache engine drive a GPU with streams and events (create,
record, wait, query) and a few device calls (synchronize, empty_cache). On a host-only machine
each of those raises. `HostCuda` gives them CPU semantics: work on the CPU is synchronous, so
every stream and event is always complete, and waiting is a no-op.

`TorchWithHostCuda` is a `torch` look-alike for one module's globals: every attribute is the real
`torch`'s except `cuda`, which is `HOST_CUDA`. Only the modules listed in
`patches/cuda_calls.py` get it; the global `torch.cuda` stays intact for everyone else.
"""

from __future__ import annotations

import contextlib
import time
import types

import torch


class HostEvent:
    """An event on the host: complete as soon as it is recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time: float | None = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds between this event's and `end_event`'s record()."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end_event._time - self._time) * 1e3


class HostStream:
    """A stream on the host: host work is synchronous, so it is always idle."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cpu")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event or HostEvent()
        event.record(self)
        return event


class HostCuda:
    """The subset of `torch.cuda` LMDeploy's engine calls, with host semantics.

    Anything else raises AttributeError naming the attribute, so a new CUDA call in a future
    LMDeploy fails loudly instead of silently doing nothing.
    """

    Stream = HostStream
    Event = HostEvent

    def __init__(self):
        self._default_stream = HostStream()

    def stream(self, stream=None):
        return contextlib.nullcontext(stream)

    def current_stream(self, device=None) -> HostStream:
        return self._default_stream

    def default_stream(self, device=None) -> HostStream:
        return self._default_stream

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def set_device(self, device) -> None:
        """A tensor-parallel rank's device choice (`ExecutorProc._main_loop` in mp_executor.py): the host has one."""

    def is_available(self) -> bool:
        return False

    def __getattr__(self, name: str):
        raise AttributeError(
            f"torch.cuda.{name} was called by LMDeploy on a host-only machine and dlinfer has no "
            f"host meaning for it (dlinfer/framework/lmdeploy_ext/host_cuda.py)."
        )


HOST_CUDA = HostCuda()


class TorchWithHostCuda(types.ModuleType):
    """`torch` for one LMDeploy module's globals, with `.cuda` replaced by HOST_CUDA."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = HOST_CUDA

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        setattr(self, name, value)  # later lookups hit the instance dict
        return value
