"""The op tools on a real LMDeploy run (docs/tools.md): the op stream of a tiny Llama's greedy
generation on CPU, captured from LMDeploy's engine thread, replays clean on the torch vendor and
fails, naming the op, on a vendor with a wrong decode attention."""

from __future__ import annotations

import json

import pytest
from support.engine_helpers import cpu_pipeline, greedy_generate
from support.wrong_ops import wrong_vendor

import dlinfer.tools as tools
from dlinfer.tools import replayer
from dlinfer.vendor import registry

pytestmark = pytest.mark.slow

PROMPTS = ("Quick red river", "The model reads a prompt token by token and the engine keeps every key")


@pytest.fixture(scope="module")
def lmdeploy_capture(tmp_path_factory):
    from support import tiny_models

    folder = tmp_path_factory.mktemp("lmdeploy-ops")
    with cpu_pipeline(tiny_models.tiny_model("llama"), enable_prefix_caching=False) as pipe:
        with tools.capture(str(folder)) as cap:
            results = greedy_generate(pipe, PROMPTS, 4)
    assert all(len(r.token_ids) == 4 for r in results)
    assert cap.saved > 0 and not cap.dropped, cap.summary_dict()
    return folder


def test_lmdeploy_capture_holds_prefill_and_decode(lmdeploy_capture):
    index = [json.loads(line) for line in (lmdeploy_capture / "calls.jsonl").read_text().splitlines()]
    ops = {m["op"] for m in index}
    assert {"prefill_attention", "paged_decode_attention", "fill_kv_cache", "linear", "add_rms_norm",
            "apply_rotary_pos_emb", "silu_and_mul"} <= ops, ops
    decode = next(m for m in index if m["op"] == "paged_decode_attention")
    saved, total = map(int, decode["kv"].split()[0:3:2])
    assert saved < total  # only the blocks the call reads, not the whole 128-block cache


def test_lmdeploy_capture_replays_clean_on_the_torch_vendor(lmdeploy_capture):
    report = replayer.replay(str(lmdeploy_capture), "torch")
    assert report.ok, report.text()


def test_lmdeploy_capture_fails_on_a_wrong_vendor(lmdeploy_capture, monkeypatch):
    monkeypatch.setitem(registry._loaded, "wrong", wrong_vendor("paged_decode_attention"))
    report = replayer.replay(str(lmdeploy_capture), "wrong")
    assert not report.ok
    assert {op for op, row in report.rows.items() if row.mismatches} == {"paged_decode_attention"}, report.text()
    assert report.failures[0].startswith("MISMATCH call #") and "paged_decode_attention out" in report.failures[0]
