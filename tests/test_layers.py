"""The package's layers import downward only (docs/design.md, "Layers"):

    framework -> graph -> ops -> tools -> vendor -> foundation (dlinfer.errors, dlinfer.envs, dlinfer.utils)

checked on the source (every import statement, top-level or inside a function) and at run time
(loading a vendor imports no upper layer; importing the lower layers imports no LMDeploy)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dlinfer"
RANK = {"framework": 3, "graph": 2, "conformance": 2, "ops": 1, "tools": 0.5, "quantize": 0.5, "vendor": 0,
        "errors": -1, "envs": -1, "utils": -1}
# The command line sits above every layer; the package's __init__ imports nothing.
EXEMPT = {"dlinfer.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str):
    parts = module.split(".")
    if len(parts) < 2:
        return None
    if parts[1] not in RANK:
        raise AssertionError(f"{module}: dlinfer.{parts[1]} belongs to no layer; add it to RANK and docs/design.md")
    return RANK[parts[1]]


def _dlinfer_imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("dlinfer."):
                yield node.lineno, name


def test_every_import_points_down_or_sideways():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module in EXEMPT or module == "dlinfer":
            continue
        own = _layer(module)
        for line, target in _dlinfer_imports(path):
            theirs = _layer(target)
            if theirs is not None and theirs > own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_relative_imports_hide_from_the_check():
    relative = [f"{p.relative_to(PACKAGE.parent)}:{n.lineno}" for p in PACKAGE.rglob("*.py")
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative


_PROBE = """
import json, sys
import dlinfer.vendor as v
name = sys.argv[1]
loaded = v.registry.try_load(name) is not None
print(json.dumps({"loaded": loaded, "why": v.failures().get(name),
                  "modules": sorted(m for m in sys.modules if m.startswith(("dlinfer.", "lmdeploy")))}))
"""


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_loading_a_vendor_imports_no_upper_layer(name):
    out = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if not report["loaded"]:
        pytest.skip(f"vendor {name} does not load here: {report['why']}")
    upper = [m for m in report["modules"] if m.startswith(("dlinfer.ops", "dlinfer.graph", "dlinfer.framework",
                                                            "lmdeploy"))]
    assert not upper, f"loading vendor {name} imported {upper}"


def test_importing_the_lower_layers_patches_nothing():
    code = ("import sys, dlinfer, dlinfer.ops, dlinfer.vendor, dlinfer.graph; "
            "print(sorted(m for m in sys.modules if m.startswith(('lmdeploy', 'dlinfer.framework'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_eager_ops_load_no_dynamo():
    """`import dlinfer.ops`, a vendor and an eager op call leave torch._dynamo (with sympy and
    Triton, ~1.4 s of start-up) unimported: only tracing needs it (ops/_dispatch.py)."""
    code = ("import sys, torch, dlinfer.ops as ops, dlinfer.vendor as v; v.load('torch'); "
            "ops.rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6); "
            "print(sorted(m for m in ('torch._dynamo', 'triton', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_constant_mark_is_the_one_torch_sets():
    """ops/_dispatch.py marks its traced-as-constant functions itself (torch's decorator imports
    Dynamo): the mark must be exactly what torch.compiler.assume_constant_result sets."""
    import torch

    from dlinfer.ops import _dispatch

    def theirs():
        return 0

    def ours():
        return 0

    assert torch.compiler.assume_constant_result(theirs) is theirs and _dispatch._constant_result(ours) is ours
    assert vars(theirs) == vars(ours) != {}
    assert vars(_dispatch._Tracing.vendor) == vars(_dispatch._Tracing.supports) == vars(ours)
