"""`python -m dlinfer env` prints what a bug report needs, and reports failures as lines."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from dlinfer.vendor.op_table import OP_NAMES

PATCH_MODULES = ("engine_config", "device_queries", "model_dtype", "awq_linear", "backend_selector", "env_check",
                 "cuda_calls", "model_agent", "window_cache", "mla_bmm", "weight_reads", "lm_head", "huge_pages",
                 "openmp_pool", "mp_engine", "mp_executor", "ray_executor", "vl_preprocess", "image_checks",
                 "request_checks", "forward_failures", "greedy_sampling")


def _run(args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def report() -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = _run(["-m", "dlinfer", "env"], env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_env_report_lists_versions_vendors_devices(report):
    for needle in ("dlinfer", "torch", "triton", "lmdeploy", "transformers", "ninja", "vendors:", "active vendor: ",
                   "devices:", "cpu:"):
        assert needle in report, (needle, report)
    assert re.search(rf"^  torch +ok .* ops={len(OP_NAMES)}/{len(OP_NAMES)}$", report, re.M), report


def test_env_report_says_what_w4_does_with_each_activation_dtype(report):
    """The cpu vendor's line is followed by what DLINFER_CPU_W4_ACTIVATIONS (unset: auto) does
    with each dtype: bfloat16 as 16-bit integers where the build runs path 5, else at its own
    precision."""
    import dlinfer.vendor

    if "cpu" not in dlinfer.vendor.available():
        pytest.skip("the cpu vendor does not load here")
    from dlinfer.vendor.cpu import weight_quant

    bf16 = "int16" if weight_quant.INT16_ACTIVATIONS else "native"
    want = rf"^ +w4 activations \(DLINFER_CPU_W4_ACTIVATIONS=auto\): bfloat16 {bf16}, float16 native, float32 native$"
    assert re.search(want, report, re.M), report


def test_env_report_gives_the_read_bandwidth_probe(report):
    line = re.search(r"^  read bw: +(\d+\.\d) GB/s \((\d+) threads x (\d+) streams, (.*); (\d+) configurations tried\)",
                     report, re.M)
    assert line, report
    assert float(line.group(1)) > 0 and int(line.group(2)) >= 1 and int(line.group(5)) >= 2, line.group(0)


def test_env_report_describes_the_machine(report):
    assert re.search(r"^  ram: +\d+\.\d GiB total, \d+\.\d GiB available$", report, re.M), report
    assert re.search(r"^  cpu: +\S", report, re.M), report
    isa = re.search(r"^  isa: +torch (\S+); cpu flags (.*)$", report, re.M)
    assert isa and isa.group(1) == torch.backends.cpu.get_cpu_capability(), report
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        assert ("avx2" in flags) == ("avx2" in isa.group(2).split()), report
    assert re.search(rf"^  cores: +{os.cpu_count()} logical", report, re.M), report
    assert re.search(r"^  threads: +torch \d+, OMP_NUM_THREADS unset$", report, re.M), report


def test_env_report_names_the_compiler(report):
    lines = [line for line in report.splitlines() if line.startswith("c++ compiler  ")]
    assert len(lines) == 1, report
    from dlinfer.vendor.cpu import build

    find_compiler = getattr(build, "find_compiler", None)
    if find_compiler is not None:
        found = find_compiler()
        assert (found[0] in lines[0]) if found else ("none found" in lines[0]), (found, lines)


def test_env_report_lists_lmdeploy_patches(report):
    assert re.search(r"^lmdeploy adaptor: LMDeploy 0\.18\.\S+ supported", report, re.M), report
    assert f"  patches: {len(PATCH_MODULES)}/{len(PATCH_MODULES)} applied" in report, report
    for name in PATCH_MODULES:
        assert re.search(rf"^    {name} +applied \((\d+)/\1 attributes replaced\)$", report, re.M), (name, report)


def test_env_reports_a_patch_that_is_not_in_place(monkeypatch):
    """The patch lines check the attributes as they are now, not what `apply()` once did. (In this
    process: the adaptor's import patches LMDeploy here as the engine tests' pipelines do, and the
    attribute is restored after the test.)"""
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    import dlinfer.__main__ as cli
    import dlinfer.framework.lmdeploy_ext  # noqa: F401
    from dlinfer.framework.lmdeploy_ext.patching import original_of

    monkeypatch.setattr(BaseModelAgent, "warmup", original_of(BaseModelAgent.__dict__["warmup"]))
    report = "\n".join(cli._lmdeploy_lines())
    assert f"  patches: {len(PATCH_MODULES) - 1}/{len(PATCH_MODULES)} applied" in report, report
    assert re.search(r"^    openmp_pool +NOT applied \(0/1 attributes replaced\)$", report, re.M), report


def test_env_reports_an_unsupported_lmdeploy_in_one_line():
    proc = _run(["-c", textwrap.dedent("""
        import lmdeploy
        lmdeploy.__version__ = "0.19.0"
        from dlinfer.__main__ import main
        main(["env", "--no-probe"])
    """)])
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout.split("\nlmdeploy adaptor:", 1)[1]
    assert section.strip().count("\n") == 0, section
    assert "unsupported" in section and "found LMDeploy 0.19.0" in section, section


def test_env_reports_a_missing_lmdeploy_in_one_line(monkeypatch):
    import dlinfer.__main__ as cli

    monkeypatch.setattr(cli, "_version", lambda dist: "not installed")
    assert cli._lmdeploy_lines() == ["lmdeploy adaptor: unavailable: LMDeploy is not installed"]


def test_vendor_failure_shows_its_first_line_only(monkeypatch):
    import dlinfer.__main__ as cli
    from dlinfer.vendor import registry, selection

    monkeypatch.setattr(selection, "current", lambda: registry.load("torch"))
    monkeypatch.setattr(registry, "known_names", lambda: ["broken"])
    monkeypatch.setattr(registry, "try_load", lambda name: None)
    monkeypatch.setattr(registry, "failures", lambda: {"broken": "RuntimeError: cannot build\n[1/7] c++ ...\n"
                                                                 "ninja: build stopped"})
    lines = cli._vendor_lines()
    assert lines[:2] == ["vendors:", "  broken     failed  RuntimeError: cannot build"], lines


def test_env_without_a_compiler(tmp_path):
    """No C++ compiler on PATH, nothing cached: one line says so, the cpu vendor fails in one line,
    and no build log reaches the report."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(empty), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    proc = _run(["-m", "dlinfer", "env"], env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    compiler = [line for line in lines if line.startswith("c++ compiler")]
    assert len(compiler) == 1 and "none found" in compiler[0], out
    both = (out + "\n" + proc.stderr).splitlines()
    about_compiler = [line for line in both
                      if "compiler" in line.lower() and not line.startswith(("  cpu ", "  DLINFER_"))]
    assert about_compiler == compiler, out
    ninja = [line for line in both if "ninja" in line and not line.startswith("ninja  ")]
    assert ninja == [], ninja
    cpu = [i for i, line in enumerate(lines) if re.match(r"  cpu +failed  \S", line)]
    assert len(cpu) == 1, out
    assert lines[cpu[0] + 1].startswith("  triton ") or lines[cpu[0] + 1].startswith("active vendor:"), out
    assert "active vendor: torch" in out, out
    assert "  read bw:      unavailable (the cpu vendor's kernels, which hold the probe, did not load)" in lines, out


def test_unknown_command_fails():
    proc = _run(["-m", "dlinfer", "nope"], timeout=120)
    assert proc.returncode != 0


TYPOS = [
    (["bench", "/nonexistent/model"], "does not exist"),
    (["bench", ".", "--mode", "fast"], "--mode 'fast'"),
    (["chat", ".", "--device", "tpu"], "--device 'tpu': expected one of cpu, dlinfer_cuda"),
]


def test_chat_and_bench_refuse_a_typo_before_importing_lmdeploy():
    """The option checks that need no LMDeploy (dlinfer/framework/lmdeploy_options.py) run before the
    command's module imports the adaptor, which patches LMDeploy and takes seconds. (Every case in
    one fresh process: none imports LMDeploy, so none can hide that another did.)"""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from dlinfer.__main__ import main
        runs = []
        for argv in {[argv for argv, _ in TYPOS]!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            modules = sorted(m for m in ("lmdeploy", "dlinfer.framework.lmdeploy_ext") if m in sys.modules)
            runs.append([code, modules, err.getvalue()])
        print(json.dumps(runs))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr[-2000:]  # nothing but the cases' own lines
    assert len(run.stdout.splitlines()) == 1, run.stdout
    runs = json.loads(run.stdout)
    for (argv, message), (code, modules, err) in zip(TYPOS, runs, strict=True):
        assert (code, modules) == (2, []), (argv, code, modules, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (argv, err)
        assert lines[0].startswith(f"python -m dlinfer {argv[0]}: error: "), (argv, err)
