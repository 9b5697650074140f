"""The conformance report: the summary table (text for stdout, Markdown) and the JSON rows, one
per check (docs/conformance.md, "Reading the report")."""

from __future__ import annotations

import json
import math
from collections import Counter

from dlinfer.conformance.inputs import dtype_name
from dlinfer.conformance.runner import FAILED, PASSED, SKIPPED, Report, Result, one_line

_MAX_LISTED = 25  # failures listed in the text summary (all of them are in the JSON report)


def _finite(value):
    """JSON without NaN / Infinity (not JSON): non-finite floats as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def row(result: Result) -> dict:
    c = result.check
    out = {"op": c.op, "dtype": dtype_name(c.dtype), "case": c.case, "status": result.status, "kind": c.kind,
           "suite": c.suite, "layout": c.layout, "id": c.id, "seconds": round(result.seconds, 4)}
    if result.reason is not None:
        out["reason"] = result.reason
    if result.declared:
        out["declared_by_vendor"] = True
    if result.tolerances:
        out["tolerance"] = [{"op": op, "dtype": dtype_name(dt), "atol": tol[0], "rtol": tol[1]}
                            for op, dt, tol in dict.fromkeys((op, dt, tuple(tol)) for op, dt, tol in result.tolerances)]
    if result.note is not None:
        out["note"] = result.note
    if result.error is not None:
        out["error"] = result.error
    return _finite(out)


def to_json(report: Report) -> dict:
    return _finite({
        "vendor": report.vendor, "device": report.device, "kv_layouts": list(report.kv_layouts),
        "versions": report.versions, "options": report.options, "seconds": round(report.seconds, 2),
        "result": "pass" if report.ok else "fail",
        "declared": {"tolerances": report.declared_tolerances, "skips": report.declared_skips},
        "summary": {"passed": report.count(PASSED), "failed": report.count(FAILED), "skipped": report.count(SKIPPED),
                    "per_op": {op: {s: report.count(s, op) for s in (PASSED, FAILED, SKIPPED)}
                               for op in report.ops()}},
        "cases": [row(r) for r in report.results],
    })


def write_json(report: Report, path) -> None:
    with open(path, "w") as f:
        json.dump(to_json(report), f, indent=1)
        f.write("\n")


def _table(report: Report):
    rows = [(op, report.count(PASSED, op), report.count(FAILED, op), report.count(SKIPPED, op)) for op in report.ops()]
    rows.append(("total", report.count(PASSED), report.count(FAILED), report.count(SKIPPED)))
    return rows


def _headline(report: Report) -> str:
    verdict = "PASS" if report.ok else f"FAIL ({report.count(FAILED)} failed)"
    return (f"dlinfer conformance: vendor {report.vendor} on {report.device} (kv layouts "
            f"{', '.join(report.kv_layouts)}): {len(report.results)} checks in {report.seconds:.1f} s: {verdict}")


def _skip_reasons(report: Report) -> list:
    return Counter(r.reason for r in report.results if r.status == SKIPPED).most_common()


def _vendor_lines(report: Report) -> list:
    lines = []
    declared_skips = [r for r in report.results if r.status == SKIPPED and r.declared]
    loose = [r for r in report.results if r.tolerances]
    if report.declared_tolerances or report.declared_skips:
        lines.append(f"the vendor's own declarations: {len(declared_skips)} checks skipped, {len(loose)} run at its "
                     f"tolerances")
        for key, (atol, rtol) in report.declared_tolerances.items():
            lines.append(f"  tolerance {key}: atol={atol:.3g} rtol={rtol:.3g}")
        for pattern, why in report.declared_skips.items():
            lines.append(f"  skip {pattern}: {why}")
    return lines


def format_text(report: Report) -> str:
    lines = [_headline(report), ""]
    lines.append(f"{'op':<28}{'passed':>8}{'failed':>8}{'skipped':>9}")
    for op, p, f, s in _table(report):
        lines.append(f"{op:<28}{p:>8}{f:>8}{s:>9}")
    skips = _skip_reasons(report)
    if skips:
        lines += ["", "skipped:"] + [f"  {n:>5} x {why}" for why, n in skips]
    vendor = _vendor_lines(report)
    if vendor:
        lines += [""] + vendor
    failed = [r for r in report.results if r.status == FAILED]
    if failed:
        lines += ["", f"failed ({len(failed)}):"]
        for r in failed[:_MAX_LISTED]:
            lines.append(f"  {r.check.id} ({r.op}): {one_line(r.error)}")
        if len(failed) > _MAX_LISTED:
            lines.append(f"  ... and {len(failed) - _MAX_LISTED} more (the JSON report, --report, lists all)")
    return "\n".join(lines)


def _md(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_markdown(report: Report) -> str:
    lines = [f"# dlinfer conformance: vendor `{report.vendor}`", "",
             f"{_headline(report)}; dlinfer {report.versions.get('dlinfer')}, torch {report.versions.get('torch')}",
             "", "| op | passed | failed | skipped |", "|---|---:|---:|---:|"]
    for op, p, f, s in _table(report):
        name = f"**{op}**" if op == "total" else f"`{op}`"
        lines.append(f"| {name} | {p} | {f} | {s} |")
    failed = [r for r in report.results if r.status == FAILED]
    if failed:
        lines += ["", "## Failures", "", "| check | op | dtype | what |", "|---|---|---|---|"]
        lines += [f"| `{_md(r.check.id)}` | `{r.op}` | {dtype_name(r.check.dtype)} | {_md(one_line(r.error))} |"
                  for r in failed]
    skips = _skip_reasons(report)
    if skips:
        lines += ["", "## Skipped", "", "| checks | why |", "|---:|---|"]
        lines += [f"| {n} | {_md(why)} |" for why, n in skips]
    vendor = _vendor_lines(report)
    if vendor:
        lines += ["", "## The vendor's own declarations", "", _md(vendor[0][0].upper() + vendor[0][1:]), ""]
        lines += [f"- {_md(line.strip())}" for line in vendor[1:]]
    return "\n".join(lines) + "\n"
