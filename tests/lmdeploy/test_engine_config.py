"""`PytorchEngineConfig(device_type="cpu")`: what it accepts, refuses and defaults to; model dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lmdeploy import PytorchEngineConfig

import dlinfer.framework.lmdeploy_ext  # noqa: F401
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patches.engine_config import HostMemoryWarning
from dlinfer.framework.lmdeploy_ext.patches.model_dtype import checkpoint_dtype, choose_dtype


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_cpu_accepts_its_dtypes(dtype):
    config = PytorchEngineConfig(device_type="cpu", dtype=dtype)
    assert (config.device_type, config.dtype) == ("cpu", dtype)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype="float16"), "cannot run dtype='float16'; choose one of 'auto', 'float32', 'bfloat16'"),
    (dict(tp=0), "tp must be at least 1"),
    (dict(ep=2), "has no expert parallel: ep must be 1, got 2"),
    (dict(tp=2, ep=2), "has no expert parallel: ep must be 1, got 2"),
    (dict(dp=2), "has no data parallel: dp must be 1, got 2"),
    (dict(quant_policy=4), "got quant_policy=4"),
    (dict(quant_policy=8, tp=2, eager_mode=True), "quant_policy=8 runs with tp=1 only"),
    (dict(enable_mp_engine=True, mp_engine_backend="ray"), "mp_engine_backend='mp' only"),
    (dict(tp=2, distributed_executor_backend="uni"), "with tp=2 runs LMDeploy's 'mp' or 'ray' executor, got"),
])
def test_cpu_refuses_what_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PytorchEngineConfig(device_type="cpu", **kwargs)


@pytest.mark.parametrize("kwargs", [dict(tp=2), dict(tp=4, distributed_executor_backend="mp"),
                                    dict(tp=1, distributed_executor_backend="mp"),
                                    dict(tp=2, distributed_executor_backend="ray")])
def test_cpu_accepts_tensor_parallel(kwargs):
    config = PytorchEngineConfig(device_type="cpu", **kwargs)
    assert config.tp == kwargs["tp"] and (config.dp, config.ep) == (1, 1)


def test_tensor_parallel_defaults_to_the_mp_executor_not_ray():
    """LMDeploy takes Ray for any ops backend that supports it; the cpu one does when asked."""
    assert PytorchEngineConfig(device_type="cpu", tp=2).distributed_executor_backend == "mp"
    assert PytorchEngineConfig(device_type="cpu", tp=1).distributed_executor_backend is None


def test_ray_on_a_device_type_without_a_ray_resource_is_refused():
    with pytest.raises(ValueError, match="device_type='dlinfer_cuda' does not run LMDeploy's Ray executor"):
        PytorchEngineConfig(device_type="dlinfer_cuda", tp=2, distributed_executor_backend="ray")


def test_lmdeploy_checks_still_apply_to_cpu():
    with pytest.raises(AssertionError, match="invalid cache_max_entry_count"):
        PytorchEngineConfig(device_type="cpu", cache_max_entry_count=1.5)
    with pytest.raises(AssertionError, match="kernel_block_size"):
        PytorchEngineConfig(device_type="cpu", block_size=8)


def test_cpu_kv_cache_default_is_small_unless_given():
    assert PytorchEngineConfig(device_type="cpu").cache_max_entry_count == devices.CPU.cache_max_entry_count == 0.1
    with pytest.warns(HostMemoryWarning, match="cache_max_entry_count=0.8 would commit up to"):  # most of the RAM
        assert PytorchEngineConfig(device_type="cpu", cache_max_entry_count=0.8).cache_max_entry_count == 0.8
    assert PytorchEngineConfig(device_type="cuda").cache_max_entry_count == 0.8


@pytest.mark.parametrize("requested,checkpoint,expected", [
    ("auto", "float32", "float32"),     # a float32 checkpoint runs in float32
    ("auto", "bfloat16", "bfloat16"),
    ("auto", "float16", "float32"),     # float16 does not run on CPU: exact widening
    ("auto", None, "float32"),
    ("bfloat16", "float32", "bfloat16"),
    ("float32", "bfloat16", "float32"),
])
def test_cpu_model_dtype(requested, checkpoint, expected):
    assert choose_dtype(devices.CPU, requested, checkpoint) == expected


def test_cpu_model_dtype_refuses_float16():
    with pytest.raises(ValueError, match="cannot run dtype='float16'"):
        choose_dtype(devices.CPU, "float16", "float32")


def test_checkpoint_dtype_reads_torch_dtype_and_text_config():
    assert checkpoint_dtype(SimpleNamespace(dtype=torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(SimpleNamespace(torch_dtype="float32")) == "float32"
    assert checkpoint_dtype(SimpleNamespace(text_config=SimpleNamespace(dtype="float16"))) == "float16"
    assert checkpoint_dtype(SimpleNamespace()) is None


def test_lmdeploy_model_config_keeps_float32_on_cpu(model_dir):
    from lmdeploy.pytorch.config import ModelConfig

    folder = model_dir("llama")
    assert ModelConfig.from_pretrained(str(folder), dtype="auto", device_type="cpu").dtype == torch.float32
    assert ModelConfig.from_pretrained(str(folder), dtype="bfloat16", device_type="cpu").dtype == torch.bfloat16
    # LMDeploy's own rule for CUDA is unchanged: float32 checkpoints run in float16 there.
    assert ModelConfig.from_pretrained(str(folder), dtype="auto", device_type="cuda").dtype == torch.float16


def test_dlinfer_cuda_device_type_resolves_to_dlinfer_backend():
    """device_type="dlinfer_cuda" (dlinfer's vendor on a CUDA GPU): configured and routed here;
    running it needs a GPU (docs/lmdeploy.md)."""
    from lmdeploy.pytorch.backends import get_backend
    from lmdeploy.pytorch.backends.dlinfer.op_backend import DlinferOpsBackend

    from dlinfer.framework.lmdeploy_ext.backend.op_backend import CpuOpsBackend, CudaOpsBackend

    config = PytorchEngineConfig(device_type="dlinfer_cuda", dtype="float16")
    assert config.cache_max_entry_count == 0.8  # LMDeploy's GPU default
    assert get_backend("dlinfer_cuda") is CudaOpsBackend and get_backend("cpu") is CpuOpsBackend
    assert issubclass(CudaOpsBackend, DlinferOpsBackend) and issubclass(CpuOpsBackend, DlinferOpsBackend)
    assert choose_dtype(devices.DLINFER_CUDA, "auto", "float16") == "float16"
