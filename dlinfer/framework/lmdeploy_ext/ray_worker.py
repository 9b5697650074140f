"""The Ray actor of one tensor-parallel rank on a dlinfer device type (patches/ray_executor.py).

Ray pickles an actor class by module and name, so a worker process imports this module to build
the actor, and importing it imports the adaptor package first: every patch is applied in the
worker before LMDeploy builds anything there (as `mp_executor.rank_process` does for the mp
executor's ranks). This module imports Ray and LMDeploy's Ray executor, so only the Ray path
imports it.
"""

from __future__ import annotations

import os

import torch
from lmdeploy.pytorch.devices import DeviceContext, get_device_manager
from lmdeploy.pytorch.engine.executor.ray_executor import RayWorkerWrapper

from dlinfer.framework.lmdeploy_ext import devices


class DlinferRayWorker(RayWorkerWrapper):
    """LMDeploy's `RayWorkerWrapper` for a dlinfer device type: the process serves that device type
    for its life (its device context set once: LMDeploy's process-group start reads the current
    one), with `threads` compute threads, and warms its collectives up on the device's torch
    device instead of "cuda"."""

    def __init__(self, *args, threads: int | None = None, **kwargs):
        device_type = kwargs.get("device_type")
        if devices.spec_for(device_type) is None:
            raise ValueError(f"DlinferRayWorker serves dlinfer's device types, got {device_type!r}")
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        get_device_manager().set_context(DeviceContext(device_type))
        super().__init__(*args, **kwargs)

    def warmup_dist(self):
        from lmdeploy.pytorch.distributed import all_reduce, get_dist_manager

        spec = devices.spec_for(self.device_type)
        with get_dist_manager().context(self.dist_ctx):
            all_reduce(torch.zeros(1, device=spec.torch_device), group=self.dist_ctx.tp_group.gpu_group)

    def get_pid(self) -> int:
        return os.getpid()
