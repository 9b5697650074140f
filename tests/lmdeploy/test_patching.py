"""What importing the adaptor does: one version gate, idempotent patches, nothing else.

Checks that need a clean interpreter (import order, a faked LMDeploy version) run in a
subprocess.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_importing_dlinfer_alone_patches_nothing():
    proc = _run("""
        import dlinfer, dlinfer.ops, dlinfer.vendor
        import lmdeploy.pytorch.backends.selector as selector
        from lmdeploy import PytorchEngineConfig
        assert "dlinfer.framework.lmdeploy_ext" not in __import__("sys").modules
        assert not hasattr(selector._get_backend, "__dlinfer_original__")
        try:
            PytorchEngineConfig(device_type="cpu")
        except AssertionError as e:
            print("rejected:", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "rejected: invalid device_type: cpu" in proc.stdout


def test_other_lmdeploy_version_is_refused_before_patching():
    proc = _run("""
        import json, lmdeploy
        import lmdeploy.pytorch.backends.selector as selector
        from lmdeploy import PytorchEngineConfig
        errors = {}
        for version in ("0.17.1", "0.19.0", "1.0.0"):
            lmdeploy.__version__ = version
            try:
                import dlinfer.framework.lmdeploy_ext
            except ImportError as e:
                errors[version] = f"{type(e).__name__}: {e}"
        assert not hasattr(selector._get_backend, "__dlinfer_original__"), "patched despite the version gate"
        try:
            PytorchEngineConfig(device_type="cpu")
            errors["patched"] = True
        except AssertionError:
            pass
        print(json.dumps(errors))
    """)
    assert proc.returncode == 0, proc.stderr
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "patched" not in errors
    for version in ("0.17.1", "0.19.0", "1.0.0"):
        assert errors[version].startswith("UnsupportedLMDeployVersion: "), errors
        assert f"supports LMDeploy 0.18.x; found LMDeploy {version}" in errors[version]


def test_version_gate_accepts_the_018_series():
    from dlinfer.framework.lmdeploy_ext.version import UnsupportedLMDeployVersion, check_lmdeploy_version

    for ok in ("0.18.0", "0.18.1", "0.18.2rc1"):
        check_lmdeploy_version(ok)
    with pytest.raises(UnsupportedLMDeployVersion, match="supports LMDeploy 0.18.x; found LMDeploy 0.1.8"):
        check_lmdeploy_version("0.1.8")


def _patched_objects():
    import lmdeploy.pytorch.backends.selector as selector
    import lmdeploy.pytorch.config as pytorch_config
    import lmdeploy.pytorch.engine.model_agent.agent as agent
    import lmdeploy.utils as utils
    from lmdeploy.messages import PytorchEngineConfig

    return {
        "selector._get_backend": selector._get_backend,
        "config._update_torch_dtype": pytorch_config._update_torch_dtype,
        "config.is_bf16_supported": pytorch_config.is_bf16_supported,
        "utils.get_max_batch_size": utils.get_max_batch_size,
        "PytorchEngineConfig.__post_init__": PytorchEngineConfig.__dict__["__post_init__"],
        "PytorchEngineConfig.__init__": PytorchEngineConfig.__dict__["__init__"],
        "BaseModelAgent.__init__": agent.BaseModelAgent.__dict__["__init__"],
        "BaseModelAgent.warmup": agent.BaseModelAgent.__dict__["warmup"],
        "agent._try_to_cuda": agent._try_to_cuda,
        "agent.torch": agent.torch,
    }


def test_import_twice_and_reload_patch_once():
    import dlinfer.framework.lmdeploy_ext as ext
    from dlinfer.framework.lmdeploy_ext.patching import is_patched, original_of

    before = _patched_objects()
    importlib.reload(ext)
    import dlinfer.framework.lmdeploy_ext  # noqa: F401,F811
    ext.patches.apply_all()
    after = _patched_objects()
    for name, obj in after.items():
        if name == "agent.torch" and torch.cuda.is_available():
            continue  # with CUDA present the engine modules keep the real torch
        assert obj is before[name], f"{name} replaced again"
        assert is_patched(obj), f"{name} not patched"
        assert not is_patched(original_of(obj)), f"{name} wraps a wrapper"


def test_global_torch_cuda_is_untouched():
    import lmdeploy.pytorch.engine.model_agent.agent as agent

    import dlinfer.framework.lmdeploy_ext  # noqa: F401
    from dlinfer.framework.lmdeploy_ext.host_cuda import HOST_CUDA

    assert sys.modules["torch"].cuda is importlib.import_module("torch.cuda")
    if not torch.cuda.is_available():
        assert agent.torch.cuda is HOST_CUDA
        assert agent.torch.Tensor is torch.Tensor and agent.torch.zeros is torch.zeros
        stream = agent.torch.cuda.Stream()
        assert stream != agent.torch.cuda.current_stream()
        event = agent.torch.cuda.Event()
        event.record()
        assert event.query() and stream.query()
        with pytest.raises(AttributeError, match="torch.cuda.get_device_name"):
            agent.torch.cuda.get_device_name(0)


def test_the_commands_know_the_adaptors_device_types():
    """lmdeploy_options.DEVICE_TYPES (the commands' check before the adaptor loads) is the adaptor's list."""
    from dlinfer.framework.lmdeploy_ext.devices import DEVICES
    from dlinfer.framework.lmdeploy_options import DEVICE_TYPES

    assert tuple(DEVICES) == DEVICE_TYPES


def test_lmdeploy_device_types_keep_lmdeploy_behaviour():
    import lmdeploy.utils as utils
    from lmdeploy import PytorchEngineConfig

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    with pytest.raises(AssertionError):  # LMDeploy's own dtype rule for its own device types
        PytorchEngineConfig(device_type="cuda", dtype="float32")
    assert PytorchEngineConfig(device_type="ascend").cache_max_entry_count == 0.8
    assert utils.get_max_batch_size("ascend") == 256 and utils.get_max_batch_size("cpu") == 64
    assert utils.is_bf16_supported("camb") is True and utils.is_bf16_supported("cpu") is True
    with pytest.raises(AssertionError):
        utils.get_max_batch_size("tpu")


def test_with_cuda_present_engine_modules_keep_real_torch_cuda():
    """On a machine with a usable CUDA device nothing of torch.cuda is redirected (simulated: the
    check that decides is `torch.cuda.is_available()`, faked before the adaptor is imported)."""
    proc = _run("""
        import torch
        torch.cuda.is_available = lambda: True
        import dlinfer.framework.lmdeploy_ext
        from dlinfer.framework.lmdeploy_ext.patches.cuda_calls import MODULES_WITH_CUDA_CALLS
        import importlib
        for name in MODULES_WITH_CUDA_CALLS:
            assert importlib.import_module(name).torch is torch, name
        import lmdeploy.pytorch.engine.model_agent.agent as agent
        assert hasattr(agent._try_to_cuda, "__dlinfer_original__")
        print("real torch kept")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "real torch kept" in proc.stdout


def test_warmup_frees_the_openmp_pool_for_dlinfer_cpu_only(monkeypatch):
    """patches/openmp_pool.py: after a CPU engine's warm-up the warm-up thread's pool is freed;
    an agent of any other device type is left alone. (That the patch is installed on
    BaseModelAgent.warmup: test_import_twice_and_reload_patch_once.)"""
    from types import SimpleNamespace

    import dlinfer.framework.lmdeploy_ext  # noqa: F401
    import dlinfer.framework.lmdeploy_ext.patches.openmp_pool as openmp_pool

    freed = []
    monkeypatch.setattr(openmp_pool, "release_thread_pool", lambda: freed.append(1) or True)
    warmup = openmp_pool._patch_warmup(lambda self: "warm")
    assert warmup(SimpleNamespace(device_ctx=SimpleNamespace(device_type="cuda"))) == "warm"
    assert freed == []
    assert warmup(SimpleNamespace(device_ctx=SimpleNamespace(device_type="cpu"))) == "warm"
    assert freed == [1]


def test_no_two_patches_replace_the_same_attribute():
    """`wrap` installs one replacement per attribute: a second patch module asking for the same
    one would be silently skipped (its behaviour lost, yet reported as applied)."""
    import dlinfer.framework.lmdeploy_ext  # noqa: F401
    from dlinfer.framework.lmdeploy_ext import patching
    from dlinfer.framework.lmdeploy_ext.patches import PATCHES

    owners = {}
    for patch in PATCHES:
        for owner, name in patching._targets.get(patch.__name__, []):
            key = (id(owner), name)
            assert key not in owners, (f"{patch.__name__} and {owners[key]} both replace "
                                       f"{getattr(owner, '__name__', owner)}.{name}")
            owners[key] = patch.__name__


def test_every_patch_has_a_row_in_the_docs():
    """docs/lmdeploy.md's patch table names every module of PATCHES, and its count is right."""
    from pathlib import Path

    from dlinfer.framework.lmdeploy_ext.patches import PATCHES

    text = (Path(__file__).resolve().parents[2] / "docs" / "lmdeploy.md").read_text()
    missing = [p.__name__.rpartition(".")[2] for p in PATCHES if f"| `{p.__name__.rpartition('.')[2]}` |" not in text]
    assert not missing, f"docs/lmdeploy.md's patch table lacks {missing}"
    words = {20: "twenty", 21: "twenty-one", 22: "twenty-two", 23: "twenty-three", 24: "twenty-four"}
    assert f"patched in {words.get(len(PATCHES), len(PATCHES))} places" in text
