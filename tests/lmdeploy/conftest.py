"""Fixtures of the LMDeploy adaptor tests: tiny models, HF references, a hang watchdog
(tests/support/fixtures.py)."""

from support.fixtures import hang_watchdog, hf_reference, model_dir  # noqa: F401
