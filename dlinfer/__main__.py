"""`python -m dlinfer env`: what a bug report needs (versions, vendors, devices)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> str:
    import torch

    import dlinfer
    from dlinfer.vendor import registry, selection

    lines = [
        f"dlinfer       {dlinfer.__version__}",
        f"python        {platform.python_version()} ({sys.executable})",
        f"platform      {platform.platform()}",
    ]
    for dist in ("torch", "triton", "lmdeploy", "transformers", "ninja"):
        lines.append(f"{dist:<13} {_version(dist)}")
    lines.append("")
    lines.append("vendors:")
    loadable = registry.available()
    for name in registry.known_names():
        if name in loadable:
            v = registry.load(name)
            extra = ""
            if name == "cpu":
                from dlinfer.vendor.cpu import build

                extra = f" kernels={build.isa()} ({build.module_name()})"
            lines.append(f"  {name:<10} ok      devices={','.join(v.device_types)} kv_layouts={','.join(v.kv_layouts)}"
                         f" ops={len(v.ops)}/11{extra}")
        else:
            lines.append(f"  {name:<10} failed  {registry.failures().get(name, '?')}")
    try:
        active = selection.current()
        lines.append(f"active vendor: {active.name} (kv layout {selection.kv_layout()})")
    except Exception as exc:  # report, don't crash: this is the bug-report command
        lines.append(f"active vendor: ERROR {type(exc).__name__}: {exc}")
    for var in ("DLINFER_VENDOR", "DLINFER_KV_LAYOUT", "DLINFER_FALLBACK_OPS", "DLINFER_CHECK_VALUES",
                "TRITON_INTERPRET"):
        if os.environ.get(var):
            lines.append(f"  {var}={os.environ[var]}")
    lines.append("")
    lines.append("devices:")
    lines.append(f"  cpu: {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}")
    else:
        lines.append("  cuda: not available")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print versions, vendors and devices")
    args = parser.parse_args(argv)
    if args.command == "env":
        print(env_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
