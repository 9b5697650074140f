"""tests/ops runs every conformance suite (dlinfer/conformance/suites): one test function
`test_<suite>` per suite, so a suite added to the package cannot go untested here."""

import ast
from pathlib import Path

from dlinfer.conformance.checks import all_suites


def test_every_conformance_suite_has_a_test():
    tests = {node.name for path in Path(__file__).parent.glob("test_*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    missing = [s.name for s in all_suites() if f"test_{s.name}" not in tests]
    assert not missing, f"conformance suites no test in tests/ops runs: {missing}"


def test_check_ids_are_unique():
    for layouts in (("token_major", "head_major"), ("token_major",), ("head_major",)):
        from dlinfer.conformance.checks import checks_for

        ids = [c.id for c in checks_for(layouts)]
        assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
