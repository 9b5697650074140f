"""scripts/gpu_check.sh, the prepared GPU check (issue 31; docs/gpu.md), in its CPU dry run: every
step runs (interpreted Triton, tiny shapes) and reports, so that no GPU minute goes to a typo."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = ["env", "big_cache", "conformance", "ops", "attention", "tiles", "engine", "conformance_fp16"]
# The dry run's conformance steps narrowed to a few ops (every suite already runs against the
# triton vendor in tests/ops/test_suites.py): what is tested here is that the steps run and report.
# The whole bf16 suite took 91 s of the dry run's 440 on a 2-core Zen 3 VM.
CONFORMANCE_CHECKS = "rms_norm[*,silu_and_mul[*,paged_decode_attention[*"


@pytest.mark.slow
@pytest.mark.triton
def test_the_dry_run_runs_every_step_and_reports(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path), "--conformance-checks",
                           CONFORMANCE_CHECKS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)  # under 3 min alone on a 2-core Zen 3 VM; the dry run's own deadline
    # is 1020 s (its budgets doubled), past the bootstrap
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "gpu_check.log").read_text()[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"gpu_check.md", "gpu_check.json", "gpu_check.log",
                                                    "conformance-bfloat16.md", "conformance-float16.md"}
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert list(steps) == STEPS and all(s["status"] == "ok" for s in steps.values()), steps
    # LMDeploy came from the sources that travel to the GPU machine (no TurboMind binaries), not the venv
    assert "/tmp/dlinfer-gpu-site." in steps["env"]["output"]["lmdeploy_from"]
    for name, ops in (("conformance", {"rms_norm", "silu_and_mul", "paged_decode_attention"}),
                      ("conformance_fp16", {"rms_norm", "silu_and_mul", "paged_decode_attention"})):
        conformance = steps[name]["output"]
        assert conformance["result"] == "pass" and conformance["options"]["checks"] == CONFORMANCE_CHECKS.split(",")
        ran = {op for op, counts in conformance["summary"]["per_op"].items() if counts["passed"]}
        assert ran == ops and conformance["summary"]["passed"] >= 20, conformance["summary"]
    assert steps["big_cache"]["output"]["ok"] is True
    ops = steps["ops"]["output"]["rows"]
    assert {"linear_w8a8", "weight_quant_matmul W4", "fused_moe", "fill_kv_cache"} <= {r["op"] for r in ops}
    assert not [r for r in ops if "error" in r]
    assert all(r["err"] == "exact" for r in ops if r["op"] == "fill_kv_cache")
    tiles = steps["tiles"]["output"]["rows"]
    assert {r["function"] for r in tiles} == {"weight_quant._group_tiles", "weight_quant._group_splits",
                                             "quant._linear_tiles", "quant.quotient_form", "attention_decode._tiles",
                                             "attention_prefill._tiles",
                                             "attention_prefill.mask_split", "moe._tiles"}, tiles
    assert all(isinstance(r.get("triton_host_us"), float) for r in ops), ops  # the host time, measured apart
    # every alternative ran and gave the launcher's own result (the dry run times nothing)
    assert all("us" in c and c["max_abs_diff"] <= 1e-2 for r in tiles for c in r["configs"]), tiles
    engine = steps["engine"]["output"]["models"]["tiny"]
    assert len(engine["tokens"]) == 2 and all(len(t) == 4 for t in engine["dlinfer_cuda"]["tokens"])
    assert set(engine["dlinfer_cuda"]["decode_tok_s"]) == {"1", "2"}
    summary = (tmp_path / "gpu_check.md").read_text()
    for heading in ("| env | ok", "## conformance: pass", "## ops", "## attention", "## tiles", "## engine",
                    "greedy tokens equal"):
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


def test_a_step_cut_off_keeps_the_checks_it_saw_fail(tmp_path):
    """A conformance step killed at its budget writes no report; the checks it printed as failing
    (`  FAILED id: why`, at once) still reach gpu_check.json and the summary."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "scripts"))
    script = ("import sys, time\n"
              "print('rms_norm   8 passed   0 failed   0 skipped', flush=True)\n"
              "print('  FAILED paged_decode_attention[token_major-b2_mla-bfloat16]: OutOfResources: shared',"
              " flush=True)\n"
              "time.sleep(60)\n")
    with open(tmp_path / "gpu_check.log", "w") as log:
        log.write("what earlier steps wrote\n  FAILED not_this_step[x]: old\n")
        result = gpu_check.run_step("conformance", [sys.executable, "-c", script], 3, log)
    assert result["status"] == "timed out after 3 s"
    assert result["failed_checks"] == ["paged_decode_attention[token_major-b2_mla-bfloat16]: OutOfResources: shared"]
    summary = gpu_check.summary({"conformance": result}, dry=False)
    assert "## conformance: timed out after 3 s; 1 checks failed before that" in summary
    assert "- paged_decode_attention[token_major-b2_mla-bfloat16]: OutOfResources" in summary


def test_conformance_checks_reach_both_conformance_steps(tmp_path):
    steps = runpy.run_path(str(REPO / "scripts" / "gpu_check.py"))["steps"]
    plan = {name: argv for name, argv, _, _ in steps(tmp_path, tmp_path, False, None, "*mla*,weight_quant*")}
    for name in ("conformance", "conformance_fp16"):
        argv = plan[name]
        assert argv[argv.index("--checks") + 1] == "*mla*,weight_quant*" and argv[argv.index("--device") + 1] == "cuda"
    assert "--ops" in plan["conformance_fp16"] and "--ops" not in plan["conformance"]
    assert plan["engine"][plan["engine"].index("--models") + 1] == "smollm2"


def test_the_engine_host_profile_names_work_and_leaves_out_waiting():
    """benchmarks/gpu_engine.py's host profile (eager GPU sides): per-token self time of torch ops
    and Python functions, idle waits left out."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_engine
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import time

    import torch

    def run(batch, new_tokens, prompts=None):
        for _ in range(40 * new_tokens):
            torch.ones(64) @ torch.ones(64)
        time.sleep(0.05)

    prof = gpu_engine.host_profile(run, 4, 2, None)
    ops = {r["op"]: r for r in prof["top_self_cpu"]}
    assert prof["batch"] == 4 and prof["wall_ms_per_step"] >= 25
    assert ops["aten::dot"]["calls_per_step"] == 40
    assert not [op for op in ops if "sleep" in op]


@pytest.mark.triton
def test_the_kernel_profile_dry_run_runs_every_case():
    """scripts/gpu_profile.sh (Nsight Compute on the GPU machine) in its CPU dry run: the cases it
    profiles build and run (interpreted, tiny shapes); ncu itself only runs there."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(["bash", "scripts/gpu_profile.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in ("weight_quant_matmul M=1", "weight_quant_matmul M=32", "paged_prefill_attention", "dynamic_quant"):
        assert f"[gpu_kernel_profile] {case}" in proc.stdout, proc.stdout
    assert "4 cases ran" in proc.stdout
