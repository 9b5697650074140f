"""scripts/gpu_check.sh, the prepared GPU check (issue 31; docs/gpu.md), in its CPU dry run: every
step runs (interpreted Triton, tiny shapes) and reports, so that no GPU minute goes to a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = ["env", "big_cache", "conformance", "ops", "attention", "engine", "conformance_fp16"]


@pytest.mark.slow
@pytest.mark.triton
def test_the_dry_run_runs_every_step_and_reports(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "gpu_check.log").read_text()[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"gpu_check.md", "gpu_check.json", "gpu_check.log",
                                                    "conformance-bfloat16.md", "conformance-float16.md"}
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert list(steps) == STEPS and all(s["status"] == "ok" for s in steps.values()), steps
    # LMDeploy came from the sources that travel to the GPU machine (no TurboMind binaries), not the venv
    assert "/tmp/dlinfer-gpu-site." in steps["env"]["output"]["lmdeploy_from"]
    assert steps["conformance"]["output"]["result"] == "pass"
    assert steps["conformance"]["output"]["summary"]["passed"] > 200
    assert steps["big_cache"]["output"]["ok"] is True
    ops = steps["ops"]["output"]["rows"]
    assert {"linear_w8a8", "weight_quant_matmul W4", "fused_moe", "fill_kv_cache"} <= {r["op"] for r in ops}
    assert not [r for r in ops if "error" in r]
    assert all(r["err"] == "exact" for r in ops if r["op"] == "fill_kv_cache")
    engine = steps["engine"]["output"]["models"]["tiny"]
    assert len(engine["tokens"]) == 8 and all(len(t) == 4 for t in engine["dlinfer_cuda"]["tokens"])
    assert set(engine["dlinfer_cuda"]["decode_tok_s"]) == {"1", "2"}
    summary = (tmp_path / "gpu_check.md").read_text()
    for heading in ("| env | ok", "## conformance: pass", "## ops", "## attention", "## engine", "greedy tokens equal"):
        assert heading in summary


def test_a_failing_step_is_reported_and_the_deadline_skips_the_rest(tmp_path):
    """Without a GPU and outside the dry run a GPU step fails: its status says so, the run's exit
    status is 1, and a step past the deadline is skipped, not started."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), "--steps",
                           "big_cache,engine"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["big_cache"]["status"] == "failed (exit 1)"
    assert "needs a CUDA GPU" in (tmp_path / "gpu_check.log").read_text()
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), "--steps", "env",
                           "--deadline", "5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert proc.returncode == 1 and steps["env"]["status"].startswith("skipped: 5 s left")


def test_unknown_steps_are_refused(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), "--steps", "engin"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown steps ['engin']" in proc.stderr
