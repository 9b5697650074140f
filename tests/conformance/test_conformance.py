"""`python -m dlinfer conformance` end to end: a deliberately wrong vendor (registered through the
`dlinfer.vendors` entry point from a temporary site directory, as a vendor package would be) fails,
and the report names the wrong op and only it; the vendor's own declarations (a tolerance, a skip)
show in the report; the summary, JSON and Markdown outputs; usage errors."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A directory that, on PYTHONPATH, makes the vendor `wrong` loadable by its entry point."""
    root = tmp_path_factory.mktemp("wrong_vendor_site")
    shutil.copy(HERE / "wrong_vendor.py", root / "wrong_vendor.py")
    info = root / "wrong_vendor-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wrong-vendor\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dlinfer.vendors]\nwrong = wrong_vendor:load\n")
    return root


def conformance(site, *args, declares=False, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               WRONG_VENDOR_DECLARES="1" if declares else "0")
    env.pop("DLINFER_FALLBACK_OPS", None)
    return subprocess.run([sys.executable, "-m", "dlinfer", "conformance", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wrong_run(site, tmp_path_factory):
    out = tmp_path_factory.mktemp("wrong_run")
    proc = conformance(site, "--vendor", "wrong", "--small", "--dtypes", "float32,bfloat16",
                       "--report", str(out / "report.json"), "--markdown", str(out / "report.md"))
    return proc, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_a_wrong_vendor_fails_and_only_its_wrong_op(wrong_run):
    proc, report, _ = wrong_run
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [r for r in report["cases"] if r["status"] == "failed"]
    assert failed and {r["op"] for r in failed} == {"rms_norm"}, sorted({r["op"] for r in failed})
    # every op ran something and passed the rest: the failure is rms_norm's alone
    per_op = report["summary"]["per_op"]
    assert set(per_op) >= {"rms_norm", "add_rms_norm", "fill_kv_cache", "paged_decode_attention", "fused_moe"}
    assert all(c["passed"] > 0 for c in per_op.values()), per_op
    assert all(c["failed"] == 0 for op, c in per_op.items() if op != "rms_norm"), per_op
    parity = [r for r in failed if r["kind"] == "parity"]
    assert {r["dtype"] for r in parity} == {"float32", "bfloat16"}
    error = next(r["error"] for r in parity if r["case"] == "t7_h80" and r["dtype"] == "float32")
    assert error["type"] == "mismatch" and error["op"] == "rms_norm"
    assert 0 < error["mismatches"] <= error["elements"] == 7 * 80
    assert error["max_abs_err"] > 0 and 0.02 < error["max_rel_err"] < 0.04  # off by 3%
    assert len(error["worst_index"]) == 2 and error["atol"] > 0


def test_the_report_rows_and_outputs(wrong_run):
    proc, report, markdown = wrong_run
    assert report["vendor"] == "wrong" and report["result"] == "fail" and report["options"]["small"] is True
    for row in report["cases"]:
        assert {"op", "dtype", "case", "status", "kind", "id"} <= set(row), row
        assert row["dtype"] in ("float32", "bfloat16"), row  # --dtypes
        assert row["status"] in ("passed", "failed", "skipped")
    assert len({r["id"] for r in report["cases"]}) == len(report["cases"])
    counts = report["summary"]
    assert counts["failed"] == sum(r["status"] == "failed" for r in report["cases"]) > 0
    # stdout: the summary table, one row per op and a total, then the failures by check id
    table = {m.group(1): tuple(map(int, m.group(2, 3, 4)))
             for m in re.finditer(r"^(\S+) +(\d+) +(\d+) +(\d+)$", proc.stdout, re.M)}
    assert table["total"] == (counts["passed"], counts["failed"], counts["skipped"]), proc.stdout
    assert table["rms_norm"][1] == counts["per_op"]["rms_norm"]["failed"]
    assert "FAIL" in proc.stdout.splitlines()[0] and re.search(r"^  rms_norm\[t7_h80-float32\] \(rms_norm\): "
                                                               r"output: \d+/560 elements off", proc.stdout, re.M)
    # stderr: a progress line per op, and each failed check as it fails (before its op's line: a
    # run killed by a time limit still names what failed)
    assert re.search(r"^rms_norm +\d+ passed +\d+ failed +\d+ skipped", proc.stderr, re.M), proc.stderr
    failed_lines = re.findall(r"^  FAILED (\S+): output: \d+/\d+ elements off", proc.stderr, re.M)
    assert len(failed_lines) == counts["failed"] and "rms_norm[t7_h80-float32]" in failed_lines, proc.stderr
    assert proc.stderr.index("  FAILED ") < re.search(r"^rms_norm +\d+ passed", proc.stderr, re.M).start()
    # Markdown: the same table
    assert "| op | passed | failed | skipped |" in markdown
    p, f, s = table["rms_norm"]
    assert f"| `rms_norm` | {p} | {f} | {s} |" in markdown and "## Failures" in markdown


def test_the_vendors_own_tolerance_and_skips_show_in_the_report(site, tmp_path):
    proc = conformance(site, "--vendor", "wrong", "--ops", "rms_norm,silu_and_mul", "--small", "--report",
                       str(tmp_path / "r.json"), declares=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["declared"] == {"tolerances": {"rms_norm": [0.05, 0.05]},
                                  "skips": {"silu_and_mul[*bfloat16*]": "our bf16 silu is approximate"}}
    loose = [r for r in report["cases"] if r.get("tolerance")]
    assert loose and all(r["op"] == "rms_norm" and r["declared_by_vendor"] for r in loose)
    assert loose[0]["tolerance"][0]["atol"] == 0.05
    skipped = [r for r in report["cases"] if r["status"] == "skipped" and r.get("declared_by_vendor")]
    assert skipped and all(r["op"] == "silu_and_mul" and r["dtype"] == "bfloat16" for r in skipped)
    assert "declared by wrong" in skipped[0]["reason"]
    assert "the vendor's own declarations" in proc.stdout


def test_usage_errors_and_list(site):
    proc = conformance(site, "--vendor", "no-such-vendor")
    assert proc.returncode == 2 and "no-such-vendor" in proc.stderr, proc.stderr
    proc = conformance(site, "--vendor", "torch", "--ops", "rms_norm,nope")
    assert proc.returncode == 2 and "nope" in proc.stderr
    proc = conformance(site, "--vendor", "torch", "--ops", "rms_norm", "--dtypes", "float32", "--small", "--list")
    assert proc.returncode == 0
    ids = proc.stdout.split()
    assert "rms_norm[t1_h64-float32]" in ids and "strided_last_dim[rms_norm]" in ids
    assert not any("float16" in i for i in ids)
