"""The op tools (dlinfer/tools, docs/tools.md) on direct op calls: capture then replay, compare,
overflow, timing, capture limits, the environment variables, and that no tool costs anything
while off (the ops resolve to the vendors' own functions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from support.wrong_ops import wrong_vendor

import dlinfer.ops as ops
import dlinfer.tools as tools
from dlinfer import __main__ as cli
from dlinfer.tools import replayer
from dlinfer.vendor import registry, selection
from dlinfer.vendor.base import HEAD_MAJOR, TOKEN_MAJOR, Vendor
from dlinfer.vendor.op_table import OP_NAMES

DL = torch.ops.dlinfer
CPU_VENDORS = [v for v in ("torch", "cpu") if registry.try_load(v) is not None]


@pytest.fixture(autouse=True)
def _no_tool_left_active():
    yield
    leftover = tools.active()
    for tool in leftover:
        tool.stop()
    assert not leftover, f"a test left tools active: {leftover}"


@pytest.fixture
def register(monkeypatch):
    def add(vendor: Vendor) -> Vendor:
        monkeypatch.setitem(registry._loaded, vendor.name, vendor)
        return vendor

    return add


def run_every_op(seed: int = 0, nb: int = 32) -> None:
    """One call of every op (float32, CPU): public functions where LMDeploy's signature is simple,
    the torch.ops.dlinfer custom ops (canonical arguments) elsewhere. Attention's `out` aliases its
    query, as LMDeploy passes it."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    t, hq, hkv, d, bs = 6, 4, 2, 32, 8
    x = randn(t, 64)
    h = ops.rms_norm(x, randn(64), 1e-6)
    DL.add_rms_norm(h, randn(t, 64), randn(64), 1e-6)
    qkv = randn(t, hq + 2 * hkv, d)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cos, sin = randn(t, d), randn(t, d)
    q, k = DL.apply_rotary_pos_emb(q.contiguous(), k.contiguous(), cos, sin)
    key_cache, value_cache = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    slots = torch.tensor([5 * bs + 0, 5 * bs + 1, 5 * bs + 2, 9 * bs + 0, 9 * bs + 1, 9 * bs + 2])
    DL.fill_kv_cache(k, v.contiguous(), key_cache, value_cache, slots, TOKEN_MAJOR)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    out = qkv[:, :hq]  # aliases the query
    DL.prefill_attention(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cu, 3, d ** -0.5, None, out)
    table = torch.tensor([[5, 0], [9, 0]], dtype=torch.int32)
    kv_len = torch.tensor([3, 3], dtype=torch.int32)
    DL.paged_prefill_attention(q, key_cache, value_cache, table, cu, kv_len, 3, 3, d ** -0.5, None,
                               torch.empty(t, hq, d), TOKEN_MAJOR)
    dq = randn(2, hq, d)
    DL.paged_decode_attention(dq, key_cache, value_cache, table, torch.tensor([0, 1, 2], dtype=torch.int32), kv_len,
                              3, d ** -0.5, None, torch.empty(2, hq, d), TOKEN_MAJOR)
    weights, ids = DL.moe_gating_topk_softmax(randn(t, 4), 2)
    DL.fused_moe(randn(t, 16), randn(4, 24, 16, scale=0.3), randn(4, 16, 12, scale=0.3), weights, ids, True)
    ops.silu_and_mul(randn(t, 24))
    ops.linear(randn(t, 48), randn(20, 48), randn(20))
    xq, x_scale = DL.dynamic_quant(randn(t, 48))
    wq = torch.randint(-127, 128, (20, 48), generator=g, dtype=torch.int8)
    DL.linear_w8a8(xq, wq, x_scale, torch.rand(20, generator=g) / 127, torch.float32, randn(20))
    DL.rms_norm_w8a8(x, randn(64), 1e-6)
    DL.add_rms_norm_w8a8(x, randn(t, 64), randn(64), 1e-6)
    qweight = torch.randint(-2**31, 2**31, (64, 3), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    DL.weight_quant_matmul(x, qweight, randn(2, 24, scale=0.02), qzeros, randn(24), 32)
    i8 = lambda *shape: torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)  # noqa: E731
    DL.fused_moe_w8a8(randn(t, 16), i8(4, 24, 16), torch.rand(4, 24, generator=g) / 500, i8(4, 16, 12),
                      torch.rand(4, 16, generator=g) / 500, weights, ids, False)
    ops.linear_w8a8_static(randn(t, 48), wq, torch.tensor([0.05]), torch.tensor([3], dtype=torch.int8),
                           torch.rand(20, generator=g) / 1000, torch.float32, torch.int8,
                           torch.randint(-100, 100, (20,), generator=g, dtype=torch.int32))
    ops.apply_rotary_pos_emb_interleaved(randn(t, hq + hkv, 1, d), randn(t, 1, 1, d), randn(t, 1, 1, d), True)


# -- off: no wrapper ---------------------------------------------------------------------------


def _vendor_functions():
    vendor = selection.current("cpu")
    torch_ops = registry.load("torch").ops
    return {op: vendor.ops.get(op, torch_ops[op]) for op in OP_NAMES}


def test_off_the_ops_resolve_to_the_vendors_own_functions():
    own = _vendor_functions()
    for op in OP_NAMES:
        assert selection.resolve(op, "cpu")[0] is own[op], op
    with tools.timing() as t:
        wrapped = selection.resolve("rms_norm", "cpu")[0]
        assert wrapped is not own["rms_norm"] and wrapped.__wrapped__ is own["rms_norm"]
        ops.rms_norm(torch.randn(2, 8), torch.ones(8))  # eager: kernel_for -> resolve
        DL.silu_and_mul(torch.randn(2, 8))  # the custom op's kernel resolves too
    assert {op for op, _ in t.totals} == {"rms_norm", "silu_and_mul"}
    for op in OP_NAMES:  # off again: every op resolves to the vendor's function itself
        assert selection.resolve(op, "cpu")[0] is own[op], op


# -- capture and replay -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("capture")
    with tools.capture(str(folder)) as cap:
        run_every_op()
    assert cap.saved == len(OP_NAMES) + 0 and not cap.dropped, cap.summary_dict()
    return folder


def test_capture_index_names_every_call_with_dtypes_and_shapes(captured):
    index = [json.loads(line) for line in (captured / "calls.jsonl").read_text().splitlines()]
    assert sorted(m["op"] for m in index) == sorted(OP_NAMES)
    calls = [m["call"] for m in index]
    assert calls == sorted(calls) and len(set(calls)) == len(calls)
    fill = next(m for m in index if m["op"] == "fill_kv_cache")
    assert fill["args"]["key_cache"] == "float32[32, 8, 2, 32]" and fill["written"] == ["key_cache", "value_cache"]
    assert fill["kv"] == "2 of 32 blocks saved"  # only the blocks its slots write
    decode = next(m for m in index if m["op"] == "paged_decode_attention")
    assert decode["kv"] == "2 of 32 blocks saved" and decode["vendor"] in CPU_VENDORS
    assert json.loads((captured / "summary.json").read_text())["saved"] == len(OP_NAMES)


@pytest.mark.parametrize("vendor", CPU_VENDORS)
def test_capture_replays_clean(captured, vendor):
    report = replayer.replay(str(captured), vendor, repeat=2)
    assert report.ok, report.text()
    assert sum(r.calls for r in report.rows.values()) == len(OP_NAMES)
    assert all(len(r.times) == 2 * r.calls for r in report.rows.values())


def test_replay_converts_the_kv_layout_for_a_vendor_without_it(captured, register):
    register(wrong_vendor("", name="headmajor", kv_layouts=(HEAD_MAJOR,)))
    report = replayer.replay(str(captured), "headmajor")
    assert report.ok, report.text()


def test_replay_on_a_wrong_vendor_fails_and_names_the_op(captured, register, capsys):
    register(wrong_vendor("paged_decode_attention"))
    assert cli.main(["replay", str(captured), "--vendor", "wrong"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH call #" in out and "paged_decode_attention out:" in out, out
    assert "FAILED: 1 mismatching calls" in out, out
    row = next(line for line in out.splitlines() if line.startswith("paged_decode_attention "))
    assert row.split()[3] == "1", row  # calls 1, mismatch 1
    # --ops leaves it out: clean
    assert cli.main(["replay", str(captured), "--vendor", "wrong", "--ops", "rms_norm,linear"]) == 0


def test_replay_of_a_missing_directory_says_so(tmp_path, capsys):
    assert cli.main(["replay", str(tmp_path / "nothing")]) == 2
    assert "no calls.jsonl" in capsys.readouterr().err


# -- compare ------------------------------------------------------------------------------------


def test_compare_reports_the_first_bad_call_of_each_op_once(register, tmp_path, capsys):
    register(wrong_vendor("rms_norm"))
    with selection.using("wrong"), tools.compare(dump_dir=str(tmp_path)) as cmp:
        for _ in range(3):
            run_every_op()
    assert set(cmp.bad_calls) == {"rms_norm"} and len(cmp.bad_calls["rms_norm"]) == 3, cmp.bad_calls
    assert len(cmp.reports) == 1 and cmp.reports[0].startswith(f"call #{cmp.bad_calls['rms_norm'][0]} rms_norm")
    err = capsys.readouterr().err
    assert err.count("[dlinfer compare]") == 1 and "hidden_states: float32[6, 64]" in err, err
    dumped = next(tmp_path.iterdir())
    assert not replayer.replay(str(dumped), "torch").ok  # the dump reproduces the difference
    assert replayer.replay(str(dumped), "wrong").ok
    assert cmp.checked == 3 * len(OP_NAMES)


def test_compare_passes_the_in_tree_vendors(register):
    for name in CPU_VENDORS:
        with selection.using(name), tools.compare() as cmp:
            run_every_op(seed=1)
        assert not cmp.bad_calls and not cmp.refused, cmp.reports


# -- overflow -----------------------------------------------------------------------------------


def test_overflow_names_the_first_call_that_writes_nan_or_inf(capsys):
    big = torch.full((2, 64), 1e3, dtype=torch.float16)
    with selection.using("torch"), tools.overflow() as watch:
        ops.rms_norm(torch.randn(2, 64), torch.ones(64))
        y = ops.linear(big, big[:1].expand(8, 64).contiguous())  # 64e6 > float16's 65504: inf
        ops.silu_and_mul(y)  # inf in, NaN/inf out: counted, not reported
    assert watch.calls == {"linear": 1, "silu_and_mul": 1}
    assert "linear (vendor torch) is the first op call that wrote NaN/inf: result (16 of 16 non-finite)" \
        in watch.first, watch.first
    assert "its inputs were finite" in watch.first
    assert capsys.readouterr().err.count("[dlinfer overflow]") == 1
    with selection.using("torch"), tools.overflow(raise_=True), pytest.raises(tools.NonFiniteOutputError):
        ops.linear(big, big[:1].expand(8, 64).contiguous())


# -- timing ------------------------------------------------------------------------------------


def test_timing_table_counts_every_call():
    with tools.timing() as t:
        run_every_op()
        run_every_op()
    rows = t.rows()
    assert {r[0] for r in rows} == set(OP_NAMES)
    assert all(r[2] == 2 for r in rows) and abs(sum(r[5] for r in rows) - 1) < 1e-9
    table = t.table()
    assert table.splitlines()[0].split() == ["op", "vendor", "calls", "total", "ms", "mean", "us", "share"]
    assert table.splitlines()[-1].split()[:3] == ["all", "ops", str(2 * len(OP_NAMES))]


# -- limits ------------------------------------------------------------------------------------


def test_capture_limits_drop_calls_with_one_message(tmp_path, capsys):
    with tools.capture(str(tmp_path / "count"), limit=3) as cap:
        run_every_op()
    assert cap.saved == 3 and cap.dropped == {"limit": len(OP_NAMES) - 3}
    err = capsys.readouterr().err
    assert err.count("call limit 3 (limit) reached at call #") == 1, err
    summary = json.loads((tmp_path / "count" / "summary.json").read_text())
    assert summary["saved"] == 3 and summary["dropped"] == {"limit": len(OP_NAMES) - 3}

    with tools.capture(str(tmp_path / "ops"), ops="linear,rms_norm:1") as cap:
        run_every_op()
        run_every_op()
    assert cap.per_op["rms_norm"]["saved"] == 1 and cap.per_op["rms_norm"]["dropped"] == 1
    assert cap.per_op["linear"]["saved"] == 2 and set(cap.per_op) == {"linear", "rms_norm"}
    assert "limit of 1 rms_norm calls (ops) reached" in capsys.readouterr().err

    with tools.capture(str(tmp_path / "bytes"), max_bytes=20_000) as cap:
        run_every_op()
    assert 0 < cap.saved < len(OP_NAMES) and cap.bytes <= 20_000 and cap.dropped["bytes"] >= 1
    assert "byte limit 19.5 KiB (max_bytes) reached" in capsys.readouterr().err
    assert replayer.replay(str(tmp_path / "bytes"), "torch").ok

    with tools.capture(str(tmp_path / "skip"), skip=4) as cap:
        run_every_op()
    assert cap.skipped == 4 and cap.saved == len(OP_NAMES) - 4


def test_capture_dedupes_big_tensors_and_cache_blocks(tmp_path):
    weight = torch.randn(256, 128)  # 128 KiB: a blob, stored once however many calls read it
    with tools.capture(str(tmp_path)) as cap:
        for _ in range(4):
            ops.linear(torch.randn(2, 128), weight)
    assert cap.saved == 4 and len(list((tmp_path / "blobs").iterdir())) == 1


def test_capture_from_threads_numbers_every_call_once(tmp_path):
    with tools.capture(str(tmp_path)) as cap:
        threads = [threading.Thread(target=run_every_op, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    index = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert cap.saved == len(index) == 3 * len(OP_NAMES)
    assert len({m["call"] for m in index}) == len(index)
    assert replayer.replay(str(tmp_path), "torch").ok


# -- environment variables ---------------------------------------------------------------------

_SCRIPT = """
import sys
sys.path[:0] = [{tools!r}, {tests!r}]
from test_op_tools import run_every_op
from dlinfer.vendor import selection
run_every_op()
run_every_op()
print("done")
"""


def test_environment_variables_start_the_tools_in_any_process(tmp_path):
    folder = tmp_path / "ops"
    env = dict(os.environ, DLINFER_OP_CAPTURE=str(folder) + "-{pid}", DLINFER_OP_CAPTURE_LIMIT="12",
               DLINFER_OP_TIMING="1", DLINFER_OP_OVERFLOW="1", DLINFER_OP_COMPARE="1")
    code = _SCRIPT.format(tools=str(Path(__file__).parent), tests=str(Path(__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
    err = proc.stderr
    assert "DLINFER_OP_CAPTURE_LIMIT" in err and "[dlinfer capture] 12 calls saved to" in err, err
    assert "[dlinfer timing]" in err and f"all ops {2 * len(OP_NAMES)}" in " ".join(err.split()), err
    assert "[dlinfer compare]" in err and "all within tolerance" in err, err
    assert "[dlinfer overflow]" not in err, err
    (capture,) = tmp_path.glob("ops-*")
    proc = subprocess.run([sys.executable, "-m", "dlinfer", "replay", str(capture), "--vendor", "torch"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: 0 mismatching calls" in proc.stdout


def test_a_bad_environment_value_names_the_variable(monkeypatch):
    from dlinfer.tools import env

    monkeypatch.setenv("DLINFER_OP_CAPTURE", "/tmp/x")
    monkeypatch.setenv("DLINFER_OP_CAPTURE_OPS", "rms_nrom")
    with pytest.raises(ValueError, match="DLINFER_OP_CAPTURE_OPS.*rms_nrom"):
        env.tools_from_env()
    monkeypatch.setenv("DLINFER_OP_CAPTURE_OPS", "")
    monkeypatch.setenv("DLINFER_OP_CAPTURE_BYTES", "lots")
    with pytest.raises(ValueError, match="DLINFER_OP_CAPTURE_BYTES"):
        env.tools_from_env()


def test_one_tolerance_table():
    """dlinfer/tools/tolerances.py and the conformance suite's table must not drift apart."""
    from dlinfer.tools import tolerances

    conformance = pytest.importorskip("dlinfer.conformance.tolerances")
    assert conformance.TOLERANCES == tolerances.TOLERANCES and conformance.FAMILY == tolerances.FAMILY


def test_top_k_ids_may_differ_only_between_tied_experts():
    from dlinfer.tools.compare import results_diffs

    names = ("result[0]", "result[1]")
    weights = torch.tensor([[0.4, 0.4, 0.2]])
    ids, swapped, wrong = torch.tensor([[1, 3, 0]]), torch.tensor([[3, 1, 0]]), torch.tensor([[1, 3, 2]])
    op = "moe_gating_topk_softmax"
    assert all(d.ok for d in results_diffs(op, names, (weights, swapped), (weights, ids), exact_results=True))
    wrong_w = torch.tensor([[0.4, 0.4, 0.1]])
    assert not results_diffs(op, names, (wrong_w, wrong), (weights, ids), exact_results=True)[1].ok
