"""Fixtures shared by the engine tests (tests/lmdeploy, tests/serving): tiny models, HF
references, a hang watchdog. Each folder's conftest.py imports them."""

from __future__ import annotations

import faulthandler
import os

import pytest

from support.engine_helpers import HFReference
from support.tiny_models import tiny_model

# Longest any single test may take before the process dumps every thread's stack and exits:
# a hang is a failure, never a stuck CI job.
HANG_TIMEOUT_S = float(os.environ.get("DLINFER_TEST_HANG_TIMEOUT", "600"))


@pytest.fixture(autouse=True)
def hang_watchdog():
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def model_dir():
    """model_dir(name) -> folder of tiny model `name`, built once (cached across sessions)."""
    return lambda name: tiny_model(name)


@pytest.fixture(scope="session")
def hf_reference():
    """hf_reference(name) -> HFReference of tiny model `name` (one HF model per session)."""
    cache: dict[str, HFReference] = {}

    def get(name: str) -> HFReference:
        if name not in cache:
            cache[name] = HFReference(tiny_model(name))
        return cache[name]

    return get
