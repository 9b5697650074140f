"""`python -m dlinfer conformance`: the command line of the conformance run (docs/conformance.md).
Building the parser imports nothing heavy; `main` runs the checks."""

from __future__ import annotations

import argparse
import sys

HELP = ("run the op conformance checks (parity against float64 references, bad inputs, garbage metadata, "
        "strided inputs, opcheck) against one vendor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vendor", required=True, help="the vendor to check (torch, cpu, triton or an out-of-tree "
                                                         "vendor's entry-point name)")
    parser.add_argument("--ops", help="comma-separated op names (default: every op)")
    parser.add_argument("--dtypes", help="comma-separated dtypes: float32,float16,bfloat16 (default: all)")
    parser.add_argument("--checks", help="comma-separated check-id patterns ('*' matches any text, e.g. "
                                         "'rms_norm[*bfloat16*]')")
    parser.add_argument("--small", action="store_true", help="small shapes only (an interpreted or slow vendor)")
    parser.add_argument("--device", help="the device to run on (default: the first of the vendor's device types "
                                         "present here)")
    parser.add_argument("--report", metavar="FILE.json", help="write one JSON row per check")
    parser.add_argument("--markdown", metavar="FILE.md", help="write the summary table as Markdown")
    parser.add_argument("--list", action="store_true", help="list the selected checks' ids and exit")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _names(text):
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


def _progress(stream):
    live = stream.isatty()
    state = {"pending": False}

    def show(line: str) -> None:
        if line.startswith("\r"):
            if live:
                stream.write("\r\033[K" + line[1:][:150])
                stream.flush()
                state["pending"] = True
            return
        if state["pending"]:
            stream.write("\r\033[K")
            state["pending"] = False
        stream.write(line + "\n")
        stream.flush()

    return show


def main(args: argparse.Namespace) -> int:
    import torch

    from dlinfer.conformance import report as rep
    from dlinfer.conformance import runner
    from dlinfer.errors import VendorError
    from dlinfer.vendor import registry
    from dlinfer.vendor.op_table import OP_NAMES

    ops = _names(args.ops)
    unknown = [op for op in ops or () if op not in OP_NAMES]
    if unknown:
        print(f"dlinfer conformance: unknown ops {unknown}; known: {', '.join(OP_NAMES)}", file=sys.stderr)
        return 2
    dtypes = None
    if args.dtypes:
        dtypes = []
        for name in _names(args.dtypes):
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                print(f"dlinfer conformance: {name!r} is not a float dtype (float32, float16, bfloat16)",
                      file=sys.stderr)
                return 2
            dtypes.append(dtype)
    patterns = _names(args.checks)
    try:
        if args.list:
            vendor = registry.load(args.vendor)
            for check in runner.select(vendor, ops, dtypes, args.small, patterns):
                print(check.id)
            return 0
        report = runner.run(args.vendor, ops=ops, dtypes=dtypes, small=args.small, device=args.device,
                            patterns=patterns, progress=None if args.quiet else _progress(sys.stderr))
    except (VendorError, ValueError) as exc:
        print(f"dlinfer conformance: {exc}", file=sys.stderr)
        return 2
    print(rep.format_text(report))
    if args.report:
        rep.write_json(report, args.report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(rep.format_markdown(report))
    return 0 if report.ok else 1
