"""`python -m dlinfer env` prints what a bug report needs."""

import subprocess
import sys


def test_env_report_lists_versions_vendors_devices():
    proc = subprocess.run([sys.executable, "-m", "dlinfer", "env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("dlinfer", "torch", "triton", "lmdeploy", "transformers", "vendors:", "active vendor: ",
                   "devices:", "cpu:"):
        assert needle in out, (needle, out)
    assert "torch      ok" in out


def test_unknown_command_fails():
    proc = subprocess.run([sys.executable, "-m", "dlinfer", "nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
