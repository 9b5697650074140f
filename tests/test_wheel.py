"""A wheel carries the cpu vendor's kernels prebuilt (setup.py), one module per instruction set, picked
at run time by the ISA torch dispatches to. Built here for AVX2 (where the CPU has it: the level an
AVX-512 machine also runs, so the tests force torch's dispatch down to it with
ATEN_CPU_CAPABILITY=avx2, as on a CPU without AVX-512), installed into a folder of its own and
imported with no C++ compiler on PATH: the cpu vendor loads them and passes its conformance suite
and the few-row walks' test (the AVX2 kernels' only run on an AVX-512 machine). Unforced on an
AVX-512 CPU the same wheel has no module for the ISA torch runs at and says so. A stamp that does
not match (edited sources) or DLINFER_CPU_PREBUILT=0 sends the vendor back to building, which then
fails with a line saying why where there is no compiler; the refused module is never imported, so a
build that follows registers the ops itself (the build path every source checkout takes, tested
throughout the suite; a second full kernel build here to show it again cost six minutes of CI on a
2-core machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dlinfer.vendor

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="the cpu vendor does not load here")]

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 900  # one instruction set: about two minutes on 2 cores (113 s on the Zen 1 VM)
RUN_TIMEOUT_S = 600
HOST_ISA = torch.backends.cpu.get_cpu_capability()  # what the cpu vendor builds for, unforced (build.isa())
WHEEL_ISA = "AVX2" if HOST_ISA in ("AVX2", "AVX512") else "DEFAULT"
FORCED = {"ATEN_CPU_CAPABILITY": WHEEL_ISA.lower()}  # torch's dispatch, and so the vendor's ISA
IGNORED = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__",
                                 ".pytest_cache", "*.so")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The folder a wheel built from a copy of this checkout was installed into (pip --target)."""

    base = tmp_path_factory.mktemp("wheel")
    src, dist, target = base / "src", base / "dist", base / "site"
    shutil.copytree(REPO, src, ignore=IGNORED)
    env = dict(os.environ, DLINFER_WHEEL_ISAS=WHEEL_ISA.lower())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(dist)], env=env,
                   check=True, timeout=BUILD_TIMEOUT_S, cwd=base)
    wheels = list(dist.glob("dlinfer-*.whl"))
    assert len(wheels) == 1, wheels
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheels[0])], check=True,
                   timeout=RUN_TIMEOUT_S)
    assert [p.name.split(".")[0] for p in (target / "dlinfer" / "vendor" / "cpu").glob("_kernels_*.so")] == [
        f"_kernels_{WHEEL_ISA.lower()}"]
    return target


def _run_without_compiler(target: Path, code: list, **extra_env):
    """`python <code>` with the installed wheel first on the path, no compiler or ninja on PATH, an
    empty torch extension cache, and no CXX."""
    env = {"HOME": str(target.parent), "PATH": "/nonexistent", "PYTHONPATH": str(target),
           "TORCH_EXTENSIONS_DIR": str(target.parent / "no-extensions"), **FORCED, **extra_env}
    return subprocess.run([sys.executable, *code], env=env, cwd=target.parent, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


PROBE = """
import sys
import dlinfer, dlinfer.vendor as v
from dlinfer.vendor.cpu import build
print(dlinfer.__file__)
print("available", "cpu" in v.available())
try:
    v.load("cpu")
    print("origin", build.origin())
except Exception as exc:
    print("error", exc)
print("prebuilt imported", any(m.startswith("dlinfer.vendor.cpu._kernels_") for m in sys.modules))
print("isa", build.isa(), sorted(m for m in sys.modules if m.startswith("dlinfer.vendor.cpu._kernels_")))
"""


def test_the_installed_wheel_loads_its_kernels_with_no_compiler(installed):
    run = _run_without_compiler(installed, ["-c", PROBE])
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(str(installed)), lines  # the wheel's dlinfer, not the checkout's
    assert "available True" in lines and "origin prebuilt" in lines, run.stdout + run.stderr
    assert f"isa {WHEEL_ISA} ['dlinfer.vendor.cpu._kernels_{WHEEL_ISA.lower()}']" in lines, lines
    assert "building" not in run.stderr


@pytest.mark.skipif(HOST_ISA != "AVX512", reason="needs a CPU with AVX-512 (the unforced ISA above the wheel's)")
def test_unforced_on_avx512_the_wheel_has_no_module_for_that_isa_and_says_so(installed):
    run = _run_without_compiler(installed, ["-c", PROBE], ATEN_CPU_CAPABILITY="avx512")
    assert "available False" in run.stdout and "no prebuilt kernels for AVX512" in run.stdout, run.stdout
    assert "prebuilt imported False" in run.stdout


def test_the_cpu_vendor_passes_its_conformance_suite_from_the_wheel(installed, tmp_path):
    """Every op of the wheel's kernels, at the suite's small shapes (the full shapes run on the
    checkout's build in tests/ops: here the question is whether the prebuilt module works)."""
    report = tmp_path / "report.json"
    run = _run_without_compiler(installed, ["-m", "dlinfer", "conformance", "--vendor", "cpu", "--quiet", "--small",
                                            "--report", str(report)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert report.stat().st_size > 0 and "building" not in run.stderr


WALKS_TEST = REPO / "tests" / "vendor" / "cpu" / "test_cpu_few_rows_walk.py"
WALKS = f"""
import sys, pytest, dlinfer, dlinfer.vendor as v
from dlinfer.vendor.cpu import build
v.load("cpu")
print("from", dlinfer.__file__, build.origin(), build.isa())
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", {str(WALKS_TEST)!r}]))
"""


def test_the_few_row_walks_of_the_wheels_kernels(installed):
    """The few-row linears' walks test against the wheel's kernels: on an AVX-512 host the one run
    of the AVX2 build's walk (two weight rows half the band apart: csrc/few_rows_walk.h,
    kPairsApart), which the checkout's AVX-512 build does not compile."""
    run = _run_without_compiler(installed, ["-c", WALKS], PYTHONDONTWRITEBYTECODE="1")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert f"from {installed}" in run.stdout and f"prebuilt {WHEEL_ISA}" in run.stdout, run.stdout[:500]
    summary = run.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def test_prebuilt_kernels_refused_for_other_sources_or_on_request(installed, tmp_path):
    """DLINFER_CPU_PREBUILT=0, or a source file that differs from the stamp: the vendor builds
    instead, and with no compiler says why in its one-line error. The stamp refuses the module
    before it is imported: a module loaded and then refused would have registered its
    torch.ops.dlinfer_cpu schemas, and the build could not register them again."""
    run = _run_without_compiler(installed, ["-c", PROBE], DLINFER_CPU_PREBUILT="0")
    assert "available False" in run.stdout and "no C++ compiler found" in run.stdout, run.stdout
    assert "DLINFER_CPU_PREBUILT=0" in run.stdout and "prebuilt imported False" in run.stdout
    edited = tmp_path / "site"
    shutil.copytree(installed, edited)
    norm = edited / "dlinfer" / "vendor" / "cpu" / "csrc" / "norm.cpp"
    norm.write_text(norm.read_text() + "\n// edited\n")
    run = _run_without_compiler(edited, ["-c", PROBE])
    assert "available False" in run.stdout and "built from other sources" in run.stdout, run.stdout
    assert "prebuilt imported False" in run.stdout  # refused from its stamp, never loaded

