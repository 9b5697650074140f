"""Tensor parallel through LMDeploy's Ray executor on the cpu device type (written against LMDeploy
0.18.0 and Ray 2.60).

Why: LMDeploy's way across machines is its Ray executor (`engine/executor/ray_executor.py`): `ray
start` on each node, then `tp` over all of them. For a dlinfer device type it fails four ways:
1. `lmdeploy.pytorch.ray.get_device_str` knows GPU, NPU and MLU only: "Unsupported device type".
2. `RayExecutor._init_workers_ray` asks Ray for a custom resource named after the device (Ray
   refuses "CPU" there: CPUs are `num_cpus`), and starts `RayWorkerWrapper`, whose process never
   imports the adaptor: its `init_backend("cpu")` would raise.
3. `RayExecutor._init_distributed_environment_by_device` raises for any device type but cuda,
   ascend, camb and maca.
4. The worker builds its process group under LMDeploy's default device context ("cuda": nccl),
   and `RayWorkerWrapper.warmup_dist` allocates on "cuda".

How, for the cpu device type (`DeviceSpec.ray_resource`; device types without one are refused
by `engine_config`), applied when `Engine` builds a Ray executor for it (`build_executor`, as
engine.py calls it), so that importing the adaptor never imports Ray:
- `get_device_str` (in `lmdeploy.pytorch.ray` and the executor module, which imported it by name)
  returns the spec's Ray resource, "CPU": LMDeploy's placement group then has one bundle of one
  CPU per rank, packed, its first bundle on the driver's node, and a cluster LMDeploy starts
  itself (`ray.init` without an address) gets as many CPUs as ranks.
- `_init_workers_ray` starts, in those bundles and in their order, one `ray_worker.DlinferRayWorker`
  per rank (Ray pickles the class by module and name, so the worker imports the adaptor first),
  asking for no resource of its own (the bundle holds it), with `threads` compute threads
  (`mp_executor.threads_per_rank`: cores / tp on one machine, or `DLINFER_THREADS_PER_RANK`, passed
  to the worker's environment), at the engine's niceness instead of Ray's 15
  (`ray_worker.take_niceness` says why).
- `_init_distributed_environment_by_device` orders the workers by node (the driver's first), as
  LMDeploy does for its device types, and sets no device.
- `forward_async` / `get_output_async` send a step's inputs and read its output over one TCP
  connection per rank (`ray_steps.StepChannels`, which says why: no object-store put and tp + 1
  actor calls a step) where `ray_steps.wanted` says so (dp = 1, no KV transfer,
  DLINFER_RAY_STEP_CHANNEL not 0); `stop` and `release` close the connections first, `sleep`
  resets them (the next step connects again). Elsewhere LMDeploy's own calls run.
- Ray 2.60 has no `ray.internal.free`, which LMDeploy's own step path calls every step and then
  logged a warning for: `release_refs` stands in (Ray frees the object when LMDeploy drops its
  reference).
- `wait_tasks`: when the ranks' tasks fail and a rank is gone, the error raised is Ray's for the
  dead rank (it names the actor), not its peer's gloo error that came first.
Everything else is LMDeploy's: the rank processes' gloo group (the spec's collective backend), a
killed rank ending the engine (`RayExecutor.wait_tasks`, and the failed step), and `release`,
which removes the placement group and shuts Ray down: a cluster the engine started ends with it;
with `RAY_ADDRESS` (an existing cluster) only this driver's connection ends.
"""

from __future__ import annotations

import functools
import os

from dlinfer import envs
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patching import wrap


def _current_spec() -> devices.DeviceSpec | None:
    from lmdeploy.pytorch.devices import get_device_manager

    return devices.spec_for(get_device_manager().current_context().device_type)


def _patch_get_device_str(original):

    @functools.wraps(original)
    def get_device_str(device_type: str = None) -> str:
        spec = devices.spec_for(device_type) if device_type is not None else _current_spec()
        if spec is None or spec.ray_resource is None:
            return original(device_type)
        return spec.ray_resource

    return get_device_str


def worker_threads(world_size: int) -> int:
    """Compute threads of each Ray rank: DLINFER_THREADS_PER_RANK, else this machine's share."""
    from dlinfer.framework.lmdeploy_ext.patches.mp_executor import threads_per_rank

    return threads_per_rank(world_size)


def _patch_init_workers(original):

    @functools.wraps(original)
    def _init_workers_ray(self, placement_group, worker_kwargs: dict):
        spec = devices.spec_for(worker_kwargs.get("device_type"))
        if spec is None:
            return original(self, placement_group, worker_kwargs)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from dlinfer.framework.lmdeploy_ext.ray_worker import DlinferRayWorker

        tp = self.dist_config.attn_tp
        bundles = [i for i, bundle in enumerate(placement_group.bundle_specs) if bundle.get(spec.ray_resource, 0)]
        if len(bundles) < tp:
            raise ValueError(f"the Ray placement group has {len(bundles)} bundle(s) with {spec.ray_resource}, "
                             f"tp={tp} needs one per rank")
        threads = worker_threads(self.dist_config.world_size)
        niceness = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None  # the engine's
        env_vars = {"OMP_NUM_THREADS": str(threads)}
        chosen = envs.get("DLINFER_THREADS_PER_RANK")
        if chosen:
            env_vars["DLINFER_THREADS_PER_RANK"] = chosen
        workers = []
        for index, bundle in enumerate(bundles[:tp]):
            strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                        placement_group_capture_child_tasks=True,
                                                        placement_group_bundle_index=bundle)
            # named, so that Ray's error for a dead rank says which (names live in this driver's namespace)
            workers.append(ray.remote(num_cpus=0, num_gpus=0, scheduling_strategy=strategy,
                                      runtime_env={"env_vars": env_vars})(DlinferRayWorker)
                           .options(name=f"dlinfer-{spec.device_type}-tp-worker-{index}-{id(self):x}")
                           .remote(threads=threads, niceness=niceness, **worker_kwargs))
        return workers

    return _init_workers_ray


def _patch_init_distributed(original):

    @functools.wraps(original)
    def _init_distributed_environment_by_device(self, device_str: str):
        if devices.spec_for(device_str) is None:
            return original(self, device_str)
        from lmdeploy.pytorch.engine.executor.ray_executor import _get_master_addr

        self.workers = self._sort_workers(_get_master_addr(), self.workers)
        return None

    return _init_distributed_environment_by_device


def _step_channels(executor):
    """The executor's `ray_steps.StepChannels`, made at its first step; None where LMDeploy's own
    forward and output calls run (`ray_steps.wanted`)."""
    steps = executor.__dict__.get("_dlinfer_steps", False)
    if steps is False:
        from dlinfer.framework.lmdeploy_ext import ray_steps

        steps = ray_steps.StepChannels(executor.workers) if ray_steps.wanted(executor) else None
        executor._dlinfer_steps = steps
    return steps


def _patch_forward_async(original):

    @functools.wraps(original)
    async def forward_async(self, inputs):
        steps = _step_channels(self)
        if steps is None:
            return await original(self, inputs)
        await steps.submit(inputs)

    return forward_async


def _patch_get_output_async(original):

    @functools.wraps(original)
    async def get_output_async(self):
        steps = _step_channels(self)
        if steps is None:
            return await original(self)
        return (await steps.next_output()).to_tensor()

    return get_output_async


def _patch_close_steps(original):
    """stop / release: the step connections are closed before LMDeploy stops or releases the ranks."""

    @functools.wraps(original)
    def close_then(self, *args, **kwargs):
        steps = self.__dict__.get("_dlinfer_steps")
        if steps:
            steps.close()
        return original(self, *args, **kwargs)

    return close_then


def _patch_sleep(original):
    """sleep: the step connections are reset first, so that the output of a step LMDeploy sent
    ahead and now drops (its agent drains its queues) is not read as the next step's."""

    @functools.wraps(original)
    async def sleep(self, *args, **kwargs):
        steps = self.__dict__.get("_dlinfer_steps")
        if steps:
            await steps.reset()
        return await original(self, *args, **kwargs)

    return sleep


def _patch_wait_tasks(original):
    """When the ranks' tasks fail because a rank died, the error raised is Ray's for the dead rank
    (it names the actor): its peers' failures (a gloo connection closed) would otherwise come first."""

    @functools.wraps(original)
    async def wait_tasks(self):
        try:
            return await original(self)
        except Exception as error:
            if devices.spec_for(self.device_type) is None:
                raise
            from dlinfer.framework.lmdeploy_ext.ray_steps import first_dead_rank

            died = await first_dead_rank(self.workers)
            if died is None:
                raise
            raise died from error

    return wait_tasks


def release_refs(refs, local_only: bool = False) -> None:
    """What `ray.internal.free` did, for Ray versions without it: nothing to do. LMDeploy's
    `RayExecutor.forward_async` frees the previous step's `ray.put` inputs with it and then drops
    its reference to them; Ray deletes an object once its last reference is gone and the tasks
    that read it are done."""


def apply_ray_patches() -> None:
    """The Ray executor's patches (idempotent): applied when the first Ray engine of a dlinfer
    device type is built, so that importing the adaptor never imports Ray."""
    import lmdeploy.pytorch.engine.executor.ray_executor as ray_executor
    import lmdeploy.pytorch.ray as lmdeploy_ray
    import ray.internal

    if not hasattr(ray.internal, "free"):  # Ray >= 2.50 has none: LMDeploy logged a warning every step
        ray.internal.free = release_refs
    wrap(lmdeploy_ray, "get_device_str", _patch_get_device_str)
    wrap(ray_executor, "get_device_str", _patch_get_device_str)
    wrap(ray_executor.RayExecutor, "_init_workers_ray", _patch_init_workers)
    wrap(ray_executor.RayExecutor, "_init_distributed_environment_by_device", _patch_init_distributed)
    wrap(ray_executor.RayExecutor, "forward_async", _patch_forward_async)
    wrap(ray_executor.RayExecutor, "get_output_async", _patch_get_output_async)
    wrap(ray_executor.RayExecutor, "wait_tasks", _patch_wait_tasks)
    wrap(ray_executor.RayExecutor, "sleep", _patch_sleep)
    wrap(ray_executor.RayExecutor, "stop", _patch_close_steps)
    wrap(ray_executor.RayExecutor, "release", _patch_close_steps)


def _patch_build_executor(original):

    @functools.wraps(original)
    def build_executor(*args, **kwargs):
        if kwargs.get("distributed_executor_backend") == "ray" and devices.spec_for(kwargs.get("device_type")):
            apply_ray_patches()
        return original(*args, **kwargs)

    return build_executor


def apply() -> None:
    import lmdeploy.pytorch.engine.engine as engine_module

    wrap(engine_module, "build_executor", _patch_build_executor)
