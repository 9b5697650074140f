"""LMDeploy's own device types served by an out-of-tree package.

LMDeploy 0.18 imports dlinfer modules by fixed paths for its device types ascend, maca and camb.
The module list is read here from LMDeploy's installed source; the example package
examples/dlinfer_vendor_ascend_example (a layout demonstration, stand-in content) is installed
into a temporary target beside the editable dlinfer, and a fresh interpreter imports every module
and name LMDeploy imports for "ascend" and runs LMDeploy's own `AscendOpsBackend.init()`, which
reaches the package's device hook through `dlinfer.framework.lmdeploy_ext.device`.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dlinfer_vendor_ascend_example"
LMDEPLOY = Path(find_spec("lmdeploy").origin).parent
DEVICES = ("ascend", "maca", "camb")

# What the ascend device type needs from a vendor package (checked against LMDeploy's source below).
ASCEND_VENDOR_MODULES = {
    "dlinfer.framework.lmdeploy_ext.cudagraph.ascend_cudagraph",
    "dlinfer.framework.lmdeploy_ext.device",  # dlinfer's; hands over to the package's entry point
    "dlinfer.vendor.ascend.version",
    "dlinfer.vendor.ascend.moe",
    "dlinfer.vendor.ascend.triton_ops.triton_utils",
}


def lmdeploy_imports(device: str) -> list:
    """[(module, [names], "lmdeploy/<file>:<line>")] for every `dlinfer` import in the LMDeploy code
    that runs for `device`: its backends/dlinfer/<device>/, the shared backends/dlinfer/*.py and
    kernels/dlinfer/, and utils.py (try_import_deeplink). Imports naming another device's
    package (moe.py's `dlinfer.vendor.ascend.moe`, taken only when vendor_name == 'ascend') are
    left to that device."""
    files = sorted((LMDEPLOY / "pytorch/backends/dlinfer").glob("*.py"))
    files += sorted((LMDEPLOY / "pytorch/backends/dlinfer" / device).glob("*.py"))
    files += sorted((LMDEPLOY / "pytorch/kernels/dlinfer").rglob("*.py")) + [LMDEPLOY / "utils.py"]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [(node.module, [a.name for a in node.names])]
            elif isinstance(node, ast.Import):
                mods = [(a.name, []) for a in node.names]
            else:
                continue
            for mod, names in mods:
                parts = mod.split(".")
                if parts[0] != "dlinfer" or any(p in DEVICES and p != device for p in parts):
                    continue
                found.append((mod, names, f"lmdeploy/{path.relative_to(LMDEPLOY).as_posix()}:{node.lineno}"))
    return found


IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, sys
    imports = json.loads(sys.argv[1])
    import dlinfer, dlinfer.vendor
    before = sorted(m for m in sys.modules if m.startswith("lmdeploy") or m.endswith("lmdeploy_ext"))
    failed = []
    for mod, names, where in imports:
        try:
            m = importlib.import_module(mod)
            missing = [n for n in names if not hasattr(m, n)]
            if missing:
                failed.append(f"{where}: {mod} lacks {missing}")
        except Exception as e:
            failed.append(f"{where}: {mod}: {type(e).__name__}: {e}")
    out = {"failed": failed, "before": before}
    if sys.argv[2] == "ascend":
        import dlinfer.vendor.ascend as asc
        import dlinfer.framework.lmdeploy_ext.patches as patches
        out["patched"] = all(now == asked and asked > 0 for now, asked in patches.status().values())
        out["files"] = {"dlinfer": dlinfer.__file__, "ascend": asc.__file__}
        calls_import = dict(asc.CALLS)
        asc.CALLS.clear()
        sys.modules.pop("dlinfer.framework.lmdeploy_ext.device")     # as in a fresh worker
        import dlinfer.framework.lmdeploy_ext.devices.hooks as hooks
        hooks._done.clear()
        from lmdeploy.pytorch.backends.dlinfer.ascend import AscendOpsBackend
        AscendOpsBackend.init()                                       # LMDeploy's own code
        out["calls_import"], out["calls_init"] = calls_import, dict(asc.CALLS)
    print("RESULT " + json.dumps(out))
    """
)


def run_check(imports, device, extra_path=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL, json.dumps(imports), device],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("ascend_example_site")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "-q", "--target", str(target), str(EXAMPLE)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    assert not (target / "dlinfer" / "__init__.py").exists()  # adds to dlinfer's packages only
    return target


def _imported_by_lmdeploy() -> set:
    """LMDEPLOY_IMPORTED_MODULES of dlinfer/framework/lmdeploy_ext/__init__.py, read from the source
    (importing the adaptor would patch LMDeploy)."""
    tree = ast.parse((ROOT / "dlinfer" / "framework" / "lmdeploy_ext" / "__init__.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "LMDEPLOY_IMPORTED_MODULES")
    return set(ast.literal_eval(node.value))


def test_module_list_matches_lmdeploy_source():
    """What LMDeploy imports from dlinfer is dlinfer's named list (whose modules exist) plus what a
    vendor package adds."""
    own = _imported_by_lmdeploy()
    packaged = {m for m in ASCEND_VENDOR_MODULES if m not in own}
    ascend = {m for m, _, _ in lmdeploy_imports("ascend")}
    assert ascend == packaged | (own - {"dlinfer.framework.lmdeploy_ext.cudagraph"}), ascend
    assert all(m.startswith("dlinfer.framework.lmdeploy_ext.cudagraph.") or m.startswith("dlinfer.vendor.ascend")
               for m in packaged), packaged
    for device in ("maca", "camb"):  # their backends import only dlinfer's own modules
        assert {m for m, _, _ in lmdeploy_imports(device)} == own - {"dlinfer.framework.lmdeploy_ext.device",
                                                                     "dlinfer.framework.lmdeploy_ext.cudagraph"}
    for module in own:
        path = ROOT / Path(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def test_ascend_modules_from_the_example_package(installed):
    out, stderr = run_check(lmdeploy_imports("ascend"), "ascend", str(installed))
    assert out["failed"] == [], out["failed"]
    assert out["before"] == [], out["before"]          # importing dlinfer patches nothing
    assert out["patched"]                                 # importing lmdeploy_ext still patches
    assert out["files"]["dlinfer"].startswith(str(ROOT))  # the editable dlinfer ...
    assert out["files"]["ascend"].startswith(str(installed))  # ... extended by the package
    assert out["calls_import"].get("init_device:ascend") == 1, out  # the device hook was reached
    # LMDeploy's AscendOpsBackend.init(): version check, device hook, triton device properties.
    assert out["calls_init"] == {"ensure_ascend_runtime": 1, "init_device:ascend": 1,
                                 "init_device_properties_triton": 1}, (out, stderr)


NEGATIVE = textwrap.dedent(
    """
    import json, sys
    out = {}
    try:
        import dlinfer.vendor.ascend
    except ModuleNotFoundError as e:
        out["ascend"] = e.name
    from dlinfer.framework.lmdeploy_ext.devices.hooks import DeviceModuleNotFound, init_device
    try:
        import dlinfer.framework.lmdeploy_ext.device
    except DeviceModuleNotFound as e:
        out["device"] = str(e)
    try:
        init_device("camb")
    except DeviceModuleNotFound as e:
        out["camb"] = str(e)
    out["cpu"] = init_device("cpu")
    print("RESULT " + json.dumps(out))
    """
)


def test_without_the_package_the_errors_name_it():
    proc = subprocess.run([sys.executable, "-c", NEGATIVE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert out["ascend"] == "dlinfer.vendor.ascend", out
    for key, chip in (("device", "Ascend"), ("camb", "Cambricon")):
        msg = out[key]
        device = "ascend" if key == "device" else "camb"
        assert f"LMDeploy device type '{device}'" in msg and chip in msg, msg
        assert f"dlinfer.vendor.{device}" in msg and "dlinfer.lmdeploy_devices" in msg, msg
    assert out["cpu"] is None  # dlinfer's own device types need no vendor package
