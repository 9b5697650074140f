"""DLINFER_HUGE_PAGES (dlinfer/framework/lmdeploy_ext/patches/huge_pages.py): a CPU engine's model
weights are moved into one huge-page arena once built, before the warm-up; the engine then gives
HF transformers' greedy tokens, eager and graph mode; `0` leaves the weights where they were
loaded; any other value is a ValueError."""

from __future__ import annotations

import pytest
from support.engine_helpers import HFReference, assert_matches_hf, cpu_pipeline, greedy_generate
from support.tiny_models import tiny_model

from dlinfer.framework.lmdeploy_ext.patches import huge_pages as patch
from dlinfer.utils import huge_pages

NEW_TOKENS = 8
PROMPTS = ("A small blue window in the dark forest", "The engine keeps every key and value in the cache")


@pytest.fixture
def moves(monkeypatch):
    """The reports of every move_to_huge_pages call the patch makes."""
    reports = []

    def spy(tensors):
        reports.append(huge_pages.move_to_huge_pages(tensors))
        return reports[-1]

    monkeypatch.setattr(patch, "move_to_huge_pages", spy)
    return reports


def _engine_model(pipe):
    runner = pipe.async_engine.engine.executor.model_agent.patched_model
    return runner.get_model() if hasattr(runner, "get_model") else runner


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graph"])
def test_weights_move_once_and_tokens_equal_hf(eager, moves, monkeypatch):
    monkeypatch.delenv(patch.ENV, raising=False)
    folder = tiny_model("llama")
    with cpu_pipeline(folder, eager_mode=eager) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        model = _engine_model(pipe)
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(moves) == 1
    if huge_pages._thp_mode() != "never":
        assert moves[0].bytes > 0 and len(storages) == 1  # every parameter lives in the one arena
    assert_matches_hf(results, HFReference(folder), NEW_TOKENS)


def test_zero_leaves_the_weights(moves, monkeypatch):
    monkeypatch.setenv(patch.ENV, "0")
    with cpu_pipeline(tiny_model("llama")) as pipe:
        model = _engine_model(pipe)
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert moves == [] and len(storages) > 1


def test_bad_value_refused_when_the_engine_is_built(monkeypatch):
    monkeypatch.setenv(patch.ENV, "yes")
    with pytest.raises(ValueError, match=r"DLINFER_HUGE_PAGES='yes': expected 1 .* or 0"):
        with cpu_pipeline(tiny_model("llama")):
            pass
