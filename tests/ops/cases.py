"""pytest glue for the conformance suites (dlinfer/conformance, docs/conformance.md).

The checks, their inputs, float64 references and tolerances live in the package, where
`python -m dlinfer conformance` runs the same ones against a single vendor. Here every suite runs
against every in-tree vendor that loads; vendors that run interpreted here (triton under
TRITON_INTERPRET=1, ~300x slower) get only the small checks. A test's id is
`<suite>-<vendor>-<the check's params>` (`-k paged_decode_attention` selects a suite).
"""

import os

import pytest

import dlinfer.vendor
from dlinfer.conformance import runner
from dlinfer.conformance.checks import Skipped, skip_reason
from dlinfer.conformance.suites import all_suites

VENDORS = tuple(dlinfer.vendor.available())
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def small_only(vendor):
    return vendor == "triton" and INTERPRETED


def vendor_marks(vendor):
    return [pytest.mark.triton] if vendor == "triton" else []


def suite_params(suite):
    """pytest params (vendor, check) of one suite for every vendor, over the KV layouts it declares;
    ids `<suite>-<vendor>[-<the check's params>]`."""
    params = []
    for vendor in VENDORS:
        for check in suite(dlinfer.vendor.load(vendor).kv_layouts):
            if small_only(vendor) and not check.small:
                continue
            pid = f"{suite.name}-{vendor}" + (f"-{check.params}" if check.params else "")
            params.append(pytest.param(vendor, check, id=pid, marks=vendor_marks(vendor)))
    return params


def all_params():
    """suite_params of every conformance suite, in the package's order."""
    return [p for suite in all_suites() for p in suite_params(suite)]


def run(vendor_name, check):
    """Run one check under the vendor; skip what its capabilities exclude (never for the torch
    vendor: the reference every op falls back to must run everything)."""
    vendor = dlinfer.vendor.load(vendor_name)
    reason, _ = skip_reason(vendor, check, capabilities=vendor_name != "torch")
    if reason is not None:
        pytest.skip(reason)
    try:
        runner.execute(vendor, check)
    except Skipped as exc:
        pytest.skip(str(exc))
