"""Engine settings a dlinfer device type cannot run are refused when the config is built, and the
CPU's defaults: a ValueError naming the setting instead of LMDeploy's engine checker exiting the
process (`SystemExit` inside `pipeline()`), a warning with the bytes when the KV cache would take
most of the free RAM, the CPU's prefill chunk size, and the multi-process engine accepted."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest
from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.disagg.config import EngineRole

import dlinfer.framework.lmdeploy_ext  # noqa: F401
from dlinfer.framework.lmdeploy_ext import devices
from dlinfer.framework.lmdeploy_ext.patches import engine_config
from dlinfer.framework.lmdeploy_ext.patches.engine_config import HostMemoryWarning

GIB = 2**30


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_batch_size=0), "max_batch_size must be at least 1 (or None for the device's default, 64), got 0"),
    (dict(max_batch_size=-4), "max_batch_size must be at least 1"),
    (dict(num_gpu_blocks=1), "num_gpu_blocks must be 0 (size the KV cache from cache_max_entry_count) or at "
                             "least 16, got 1"),
    (dict(num_gpu_blocks=15), "num_gpu_blocks must be 0"),
    (dict(max_prefill_token_num=0), "max_prefill_token_num (tokens per prefill step) must be at least 1, got 0"),
    (dict(thread_safe=True), "thread_safe=True is no longer supported"),
    (dict(role=EngineRole.Prefill, block_size=64, kernel_block_size=32),
     "role=Prefill (PD migration) needs block_size == kernel_block_size, got 64 and 32"),
])
def test_impossible_settings_are_a_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(f"device_type='cpu': {message}")):
        PytorchEngineConfig(device_type="cpu", **kwargs)


def test_multi_process_engine_other_than_mp_is_refused():
    with pytest.raises(ValueError, match="runs the multi-process engine with mp_engine_backend='mp' only, got "
                                         "mp_engine_backend='ray'"):
        PytorchEngineConfig(device_type="cpu", enable_mp_engine=True, mp_engine_backend="ray")


def test_the_limits_themselves_are_accepted():
    assert PytorchEngineConfig(device_type="cpu", max_batch_size=1).max_batch_size == 1
    assert PytorchEngineConfig(device_type="cpu", num_gpu_blocks=16).num_gpu_blocks == 16
    assert PytorchEngineConfig(device_type="cpu", max_prefill_token_num=1).max_prefill_token_num == 1
    config = PytorchEngineConfig(device_type="cpu", enable_mp_engine=True)
    assert config.enable_mp_engine and config.mp_engine_backend == "mp"


def test_lmdeploy_device_types_keep_lmdeploy_checks():
    """dlinfer refuses nothing for LMDeploy's own device types: there the checker still decides."""
    assert PytorchEngineConfig(device_type="cuda", max_batch_size=0, num_gpu_blocks=4).num_gpu_blocks == 4


def test_impossible_setting_fails_before_the_engine_is_built(model_dir):
    """`pipeline()` used to end in SystemExit from LMDeploy's EngineChecker; now the config refuses."""
    from lmdeploy import pipeline

    with pytest.raises(ValueError, match="max_batch_size must be at least 1"):
        pipeline(str(model_dir("llama")), backend_config=PytorchEngineConfig(device_type="cpu", max_batch_size=0))


def _fake_ram(monkeypatch, available: int, total: int) -> None:
    monkeypatch.setattr(engine_config.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=available, total=total))


def test_kv_share_of_half_the_free_ram_warns_with_the_bytes(monkeypatch):
    _fake_ram(monkeypatch, available=22 * GIB, total=24 * GIB)
    with pytest.warns(HostMemoryWarning) as record:
        PytorchEngineConfig(device_type="cpu", cache_max_entry_count=0.5)
    message = str(record[0].message)
    assert f"cache_max_entry_count=0.5 would commit up to {11 * GIB} bytes (11.0 GiB)" in message, message
    assert "50% of the 22.0 GiB available now (24.0 GiB total)" in message, message
    assert record[0].filename == __file__  # points at the caller's line


@pytest.mark.parametrize("kwargs", [dict(), dict(cache_max_entry_count=0.49),
                                    dict(cache_max_entry_count=0.9, num_gpu_blocks=64)])
def test_no_warning_below_the_threshold_or_with_explicit_blocks(kwargs, monkeypatch):
    _fake_ram(monkeypatch, available=22 * GIB, total=24 * GIB)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)
        PytorchEngineConfig(device_type="cpu", **kwargs)
    assert devices.CPU.kv_cache_warn_share == 0.5


def test_no_host_memory_warning_for_gpu_device_types(monkeypatch):
    _fake_ram(monkeypatch, available=22 * GIB, total=24 * GIB)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)
        PytorchEngineConfig(device_type="dlinfer_cuda", dtype="float16", cache_max_entry_count=0.9)
        PytorchEngineConfig(device_type="cuda", cache_max_entry_count=0.9)


def test_cpu_prefills_in_chunks_by_default():
    assert devices.CPU.max_prefill_token_num == 512
    assert PytorchEngineConfig(device_type="cpu").max_prefill_token_num == 512
    # None is "the device's default" (what `python -m dlinfer serve` passes when the option is not given)
    assert PytorchEngineConfig(device_type="cpu", max_prefill_token_num=None).max_prefill_token_num == 512
    assert PytorchEngineConfig(device_type="cpu", cache_max_entry_count=None).cache_max_entry_count == 0.1
    assert PytorchEngineConfig(device_type="cpu", max_prefill_token_num=4096).max_prefill_token_num == 4096
    # LMDeploy's default elsewhere
    assert PytorchEngineConfig(device_type="cuda").max_prefill_token_num == 8192
    config = PytorchEngineConfig(device_type="dlinfer_cuda", dtype="float16", max_prefill_token_num=None)
    assert (config.max_prefill_token_num, config.cache_max_entry_count) == (8192, 0.8)
