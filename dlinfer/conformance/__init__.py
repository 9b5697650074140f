"""Conformance checks for vendor authors: `python -m dlinfer conformance --vendor NAME`
(docs/conformance.md).

The checks and their float64 references ship in the package, so `pip install dlinfer` plus a
vendor package is enough to run them; tests/ops runs the very same checks, suite by suite,
against every in-tree vendor. Layer: above dlinfer.ops and dlinfer.vendor (it calls the public
ops and selects vendors), beside dlinfer.graph (docs/design.md, "Layers").

  inputs.py      devices, seeded inputs, paged caches, NaN-fenced caches
  reference.py   independent float64 references of every op
  tolerances.py  the tolerance table (+ a vendor's declared tolerances)
  compare.py     comparisons that fail with counts, worst errors and indices
  checks.py      Check, the suite registry, skips (capabilities, vendor declarations)
  suites/        the checks, one module per op family plus strided, bad inputs, garbage, opcheck
  runner.py      run(vendor) -> Report;  report.py: text, Markdown, JSON;  cli.py: the command

Importing this package imports nothing else (the command line builds its parser from cli.py
without loading torch).
"""


def run(vendor_name, **kwargs):
    """dlinfer.conformance.runner.run: run the checks against a vendor, return the Report."""
    from dlinfer.conformance.runner import run as _run

    return _run(vendor_name, **kwargs)
