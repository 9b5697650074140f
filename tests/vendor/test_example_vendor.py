"""The example out-of-tree vendor installs, registers through its entry point and gets selected."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dlinfer_vendor_example"

CHECK = textwrap.dedent(
    """
    import sys, warnings
    sys.path.insert(0, sys.argv[1])
    import torch
    import dlinfer.ops as ops
    import dlinfer.vendor as V
    from dlinfer.errors import UnsupportedError, VendorError

    assert "example" in V.available(), V.available()
    assert V.vendor_name == "example", V.vendor_name          # picked by DLINFER_VENDOR
    import dlinfer_vendor_example as ex

    x, w = torch.randn(3, 40), torch.randn(40)
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref)
    assert ex.CALLS["rms_norm"] == 1
    ops.silu_and_mul(torch.randn(2, 8))
    assert ex.CALLS["silu_and_mul"] == 1

    with warnings.catch_warnings(record=True) as caught:   # linear: not in the vendor -> torch
        warnings.simplefilter("always")
        ops.linear(x, torch.randn(5, 40))
        ops.linear(x, torch.randn(5, 40))
    fallback = [c for c in caught if "falls back to the torch vendor" in str(c.message)]
    assert len(fallback) == 1, [str(c.message) for c in caught]   # warned once

    try:                                                  # a capability the vendor lacks
        ops.rms_norm(x.half(), w.half(), 1e-6)
    except UnsupportedError as e:
        assert "example" in str(e) and "rms_norm" in str(e), e
    else:
        raise AssertionError("float16 should be unsupported by the example vendor")

    try:
        V.use("no-such-vendor")
    except VendorError as e:
        assert "example" in str(e) and "torch" in str(e), e   # lists the vendors that load
    else:
        raise AssertionError("unknown vendor accepted")
    print("EXAMPLE VENDOR OK")
    """
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("example_vendor_site")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "-q", "--target", str(target), str(EXAMPLE)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return target


def test_example_vendor_selected_through_entry_point(installed):
    env = dict(os.environ, DLINFER_VENDOR="example")
    env.pop("DLINFER_FALLBACK_OPS", None)
    proc = subprocess.run([sys.executable, "-c", CHECK, str(installed)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EXAMPLE VENDOR OK" in proc.stdout


def test_named_vendor_that_cannot_load_is_an_error(installed):
    env = dict(os.environ, DLINFER_VENDOR="example")
    code = "import torch, dlinfer.ops as ops; ops.rms_norm(torch.ones(2, 4), torch.ones(4))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)  # not on path
    assert proc.returncode != 0
    assert "VendorError" in proc.stderr and "'example'" in proc.stderr and "torch" in proc.stderr


def test_forced_fallback_env(installed):
    env = dict(os.environ, DLINFER_VENDOR="example", DLINFER_FALLBACK_OPS="rms_norm")
    code = textwrap.dedent(
        """
        import sys, warnings; sys.path.insert(0, sys.argv[1])
        import torch, dlinfer.ops as ops, dlinfer_vendor_example as ex
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ops.rms_norm(torch.ones(2, 4), torch.ones(4))
        assert ex.CALLS["rms_norm"] == 0
        assert any("DLINFER_FALLBACK_OPS" in str(c.message) for c in caught)
        print("FORCED OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code, str(installed)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_conformance_on_the_example_vendor(installed, tmp_path):
    """`python -m dlinfer conformance` on the out-of-tree vendor, found through its entry point:
    its ops pass; float16, which it does not declare, and the ops it lacks are skipped, not failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")]))
    env.pop("DLINFER_FALLBACK_OPS", None)
    report_path = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "dlinfer", "conformance", "--vendor", "example", "--report",
                           str(report_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vendor example" in proc.stdout and ": PASS" in proc.stdout.splitlines()[0], proc.stdout
    report = json.loads(report_path.read_text())
    assert report["vendor"] == "example" and report["kv_layouts"] == ["token_major"]
    per_op = report["summary"]["per_op"]
    assert per_op["rms_norm"]["passed"] > 0 and per_op["silu_and_mul"]["passed"] > 0
    assert report["summary"]["failed"] == 0
    for row in report["cases"]:
        if row["status"] != "skipped":
            assert row["op"] in ("rms_norm", "silu_and_mul") and row["dtype"] != "float16", row
        elif row["op"] in ("rms_norm", "silu_and_mul"):
            assert row["dtype"] == "float16" and "declares no float16" in row["reason"], row
        else:
            assert "not in example's op table" in row["reason"], row
