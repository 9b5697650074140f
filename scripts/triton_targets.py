"""Compile, without a GPU, every Triton launch the triton vendor makes for the conformance checks,
for NVIDIA targets (sm_90 and sm_80 by default), and report each kernel configuration's shared
memory against the target's per-block limit, and the compiler's errors.

    python scripts/triton_targets.py [--ops a,b] [--dtypes bfloat16] [--small] [--targets 90,80] [--json FILE]

How: the conformance checks run on the CPU with Triton's launch replaced by a recorder (nothing
runs, so the checks' own results mean nothing and are ignored); each distinct launch (kernel,
argument types, compile-time constants, num_warps / num_stages) is then compiled with
`triton.compile(..., target=GPUTarget("cuda", cc, 32))`, which needs Triton's bundled ptxas but
no driver. A configuration that needs more shared memory than the target has fails on the GPU
at its first launch ("out of resources"), so this finds it here. Exit status 1 when any launch
does not fit or does not compile.

Run it without TRITON_INTERPRET (the interpreter replaces the kernels' compiled form).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Shared memory one block may use (bytes, the opt-in maximum): CUDA's per-architecture tables.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}

_TYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int8": "i8",
               "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1"}


def arg_type(name: str, value) -> str:
    """Triton's signature type of one runtime argument (as the launcher would specialise it)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TYPE_NAMES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    raise TypeError(f"argument {name}: cannot type {type(value).__name__}")


class Recorder:
    """Replaces JITFunction.run: records (kernel, signature, constants, options) of each launch."""

    def __init__(self):
        self.launches = {}  # key -> (kernel, signature, constexprs, options, where)

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self._saved = JITFunction.run
        recorder = self

        def run(fn, *args, grid, warmup=False, **kwargs):
            recorder.record(fn, args, kwargs)

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._saved

    def record(self, fn, args, kwargs):
        values = dict(zip(fn.arg_names, args))
        values.update(kwargs)
        options = {k: values.pop(k) for k in ("num_warps", "num_stages") if k in values}
        signature, constexprs = {}, {}
        for i, p in enumerate(fn.params):
            if p.name not in values:  # a default
                continue
            v = values[p.name]
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[(i,)] = v
            else:
                signature[p.name] = arg_type(p.name, v)
                if signature[p.name] == "constexpr":
                    constexprs[(i,)] = None
        key = (fn.fn.__module__, fn.fn.__name__, tuple(sorted(signature.items())),
               tuple(sorted((k[0], repr(v)) for k, v in constexprs.items())), tuple(sorted(options.items())))
        if key not in self.launches:
            consts = {fn.arg_names[k[0]]: v for k, v in constexprs.items() if v is not None}
            self.launches[key] = (fn, signature, constexprs, options, consts)


def compile_for(fn, signature, constexprs, options, cc: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", cc, 32), options=options)
    except Exception as exc:  # the compiler's own error: report it
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                "seconds": round(time.perf_counter() - start, 2)}
    shared = int(kernel.metadata.shared)
    limit = SHARED_LIMIT.get(cc)
    return {"ok": limit is None or shared <= limit, "shared": shared, "limit": limit,
            "num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages,
            **registers(kernel.asm["ptx"], cc), "seconds": round(time.perf_counter() - start, 2)}


def registers(ptx: str, cc: int) -> dict:
    """Registers per thread and spilled bytes, from Triton's bundled ptxas run verbosely on the
    kernel's PTX (spills: local-memory traffic in the inner loop, a common reason a kernel runs
    far below its bandwidth)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None:
        return {"registers": None, "spill_bytes": None}
    return {"registers": int(regs.group(1)),
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else 0}


def record_conformance(ops, dtypes, small, patterns=None) -> Recorder:
    """Runs the selected conformance checks of the triton vendor on the CPU with launches recorded."""
    import importlib
    import pkgutil

    import dlinfer.vendor.triton as package
    from dlinfer.conformance import runner
    from dlinfer.vendor.triton import _common

    # The vendor claims CPU tensors only under the interpreter. Here its kernels are the compiled
    # ones (nothing runs), so let it take them: every kernel module is imported first, binding the
    # real INTERPRET (False), and only the vendor's device list then reads the flag set to True.
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    _common.INTERPRET = True
    with Recorder() as rec:
        runner.run("triton", ops=ops, dtypes=dtypes, small=small, device="cpu", patterns=patterns)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", help="comma-separated op names (default: every op)")
    ap.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated dtypes (default bfloat16,float16)")
    ap.add_argument("--checks", help="comma-separated check-id patterns, as the conformance command takes them")
    ap.add_argument("--small", action="store_true", help="the conformance suite's small shapes only")
    ap.add_argument("--targets", default="90,80", help="compute capabilities, comma-separated (default 90,80)")
    ap.add_argument("--json", help="write every launch's result here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("triton_targets: unset TRITON_INTERPRET (the interpreter has no compiled kernels)", file=sys.stderr)
        return 2
    import torch

    ops = args.ops.split(",") if args.ops else None
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    targets = [int(t) for t in args.targets.split(",")]
    t0 = time.perf_counter()
    rec = record_conformance(ops, dtypes, args.small, args.checks.split(",") if args.checks else None)
    print(f"[triton_targets] {len(rec.launches)} distinct launches recorded in {time.perf_counter() - t0:.0f} s; "
          f"compiling for sm_{', sm_'.join(map(str, targets))}", file=sys.stderr)
    rows, bad = [], 0
    for fn, signature, constexprs, options, consts in rec.launches.values():
        name = f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}"
        shown = {k: v for k, v in consts.items() if k.isupper()}
        for cc in targets:
            res = compile_for(fn, signature, constexprs, options, cc)
            row = {"kernel": name, "target": f"sm_{cc}", "constexprs": {k: repr(v) for k, v in consts.items()},
                   "options": options, **res}
            rows.append(row)
            if not res["ok"]:
                bad += 1
            what = (f"shared {res['shared']:>6} of {res['limit']}, {res['registers']} registers, "
                    f"{res['spill_bytes']} bytes spilled" if "shared" in res else res["error"])
            print(f"{'ok ' if res['ok'] else 'BAD'} sm_{cc} {name} {shown} {options}: {what}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"[triton_targets] {len(rows)} compilations, {bad} that do not fit or do not compile", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
