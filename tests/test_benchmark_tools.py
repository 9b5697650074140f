"""The benchmark tools that real-shape measurements rest on: the random checkpoints hold exactly
the tensors HF's LlamaForCausalLM has at those shapes, and llama-bench's step bytes skip only the
embedding table that the head does not read."""

from __future__ import annotations

import make_checkpoint  # noqa: E402
import pytest
import torch


@pytest.mark.parametrize("shape", sorted(make_checkpoint.SHAPES))
def test_random_checkpoints_have_hf_llamas_tensors(shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = make_checkpoint.SHAPES[shape]
    config = LlamaConfig.from_dict(make_checkpoint.config(s, "bfloat16"))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if s.tied:
        expected.pop("lm_head.weight")  # tied: HF saves the table once
    assert dict(make_checkpoint.tensor_shapes(s)) == expected
    params = sum(torch.Size(shape).numel() for _, shape in make_checkpoint.tensor_shapes(s))
    assert params / 1e9 == pytest.approx({"llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3-8b": 8.03,
                                          "smollm2-135m": 0.135}[shape],
                                         abs=0.01)


def test_a_small_checkpoint_loads_in_hf_and_decodes_every_id(tmp_path):
    """Built end to end (weights, config, tokenizer) at a toy shape: HF loads it, and the tokenizer
    decodes every id of the vocabulary (a random model may pick any)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    toy = make_checkpoint.Shape(64, 2, 4, 2, 16, 128, 49152 + 40, True, None, 512)
    make_checkpoint.SHAPES["toy"] = toy
    try:
        folder = make_checkpoint.build("toy", "bfloat16", out=tmp_path / "toy", shard_gb=0.003, log=lambda m: None)
    finally:
        del make_checkpoint.SHAPES["toy"]
    assert len(list(folder.glob("model-*.safetensors"))) >= 2  # sharded, with an index
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert model.config.vocab_size == toy.vocab and model.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == toy.vocab
    assert tok.decode([toy.vocab - 1]) == f"<|reserved_{39}|>"


def test_gguf_step_bytes_skips_an_unread_embedding(tmp_path):
    import gguf
    import numpy as np
    from llama_bench import gguf_step_bytes

    def write(path, names):
        w = gguf.GGUFWriter(str(path), "llama")
        for name in names:
            w.add_tensor(name, np.zeros((8, 16), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.attn_q.weight"])
    write(tmp_path / "untied.gguf", ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"])
    assert gguf_step_bytes(tmp_path / "tied.gguf") == 2 * 8 * 16 * 4
    assert gguf_step_bytes(tmp_path / "untied.gguf") == 2 * 8 * 16 * 4


@pytest.mark.parametrize("kernel", ["f32", "bf16", "w8a8", "w4-ct", "w4-ki", "w4-a8", "w4-a16"])
def test_hot_sides_fit_their_budget_and_keep_k(kernel):
    """bench_weight_stream --hot: a side's weight is cut to fit the budget (N a whole number of the
    layout's column tiles, at least one, never above the model's), K untouched, and the bytes one call
    of the cut side reads are the cut weight's (no padding past N); without --hot the model's shape."""
    import bench_weight_stream as bws

    if not bws.side_runs(kernel):
        pytest.skip(f"{kernel} does not run on this build")
    model = bws.MODELS["1b"]
    tile = bws.COLUMN_TILE.get(kernel, 64)
    g = torch.Generator().manual_seed(0)
    for lname, (k, n) in model.linears().items():
        assert bws.shape(model, lname, kernel, None) == (k, n)
        hk, hn = bws.shape(model, lname, kernel, 2)
        assert hk == k and hn % tile == 0 and tile <= hn <= n
        weight_bytes = hn * k * bws.BYTES_PER_WEIGHT[kernel]
        assert weight_bytes <= 2e6 or hn == tile
        _, nbytes = bws.make_weights(kernel, hk, hn, 0, g, copies=1)
        assert weight_bytes <= nbytes <= 1.1 * weight_bytes, (lname, hn, nbytes)
        if kernel in ("w4-a8", "w4-a16"):  # its calls run path 4 / 5 on the cut weight
            calls = bws.make_calls(kernel, *bws.make_weights(kernel, hk, hn, 0, g, copies=1)[:1], 2, hk, g)
            assert calls[0]().shape == (2, hn)


def test_streams_sides_alternate_the_setting_and_restore_it():
    """bench_weight_stream --streams: every round times each setting once, in turn (reversed every
    other round), each call under its own setting, and the setting in force comes back after, also
    when a call raises."""
    import bench_weight_stream as bws

    import dlinfer.vendor

    if "cpu" not in dlinfer.vendor.available():
        pytest.skip("cpu vendor cannot load here")
    ops = torch.ops.dlinfer_cpu
    seen = []

    class Probe:
        def measure(self):
            seen.append("probe")
            return 1e9

    in_force = ops.weight_streams()
    results = bws.measure([lambda: seen.append(ops.weight_streams())], 1000, Probe(), 2, settings=(1, 4))
    assert set(results) == {1, 4}
    assert all(r.share > 0 for r in results.values())
    timed = [s for s in seen if s != "probe"]
    assert timed == [1, 4, 1, 4, 4, 1]  # the warm-up (its one call a setting), then rounds 1, 4 and 4, 1
    assert ops.weight_streams() == in_force

    def fails_under_four():
        if ops.weight_streams() == 4:
            raise RuntimeError("the call under test failed")

    ops.set_weight_streams(2)
    try:
        with pytest.raises(RuntimeError, match="the call under test failed"):
            bws.measure([fails_under_four], 1000, Probe(), 2, settings=(1, 4))
        assert ops.weight_streams() == 2  # restored although a call raised
    finally:
        ops.set_weight_streams(in_force)


def test_e2e_rounds_pair_each_side_with_the_baseline_and_the_probe_of_that_round(monkeypatch):
    """e2e_cpu's decode_rates keeps each round's batch-1 rate per side with the probe reading taken
    just before it, and render_paired compares sides round by round: a side that is twice and four
    times the baseline in its two rounds reads 3.00x (2.00-4.00), whatever the best rounds were."""
    import e2e_cpu

    monkeypatch.setattr(e2e_cpu.time, "sleep", lambda s: None)
    state = {"round": 0}
    slowness = {"a": [1.0, 2.0], "b": [0.5, 0.5]}  # a: 10 then 5 tokens/s at batch 1; b: 20, 20

    class Worker:
        def __init__(self, name):
            self.name = name

        def run_batch(self, batch, n):  # T(n) = 0.2 s + (n - 1) x 0.1 s x slowness
            return 0.2 + (n - 1) * 0.1 * slowness[self.name][state["round"]]

    class Probe:
        def measure(self):  # 1 GB/s in round 0, 2 GB/s in round 1
            return 1e9 * (state["round"] + 1)

    bench_rates = [12.0, 18.0]

    def bench():
        rate = bench_rates[state["round"]]
        state["round"] = min(state["round"] + 1, 1)
        return rate

    rates, readings, rounds = e2e_cpu.decode_rates([Worker("a"), Worker("b")], 5, 2, Probe(), {"llama": bench})
    assert rates["a"][1] == pytest.approx(10.0) and rates["b"][1] == pytest.approx(20.0)  # best of the rounds
    assert rates["llama"] == {1: 18.0, 8: None}
    assert [r for r, _ in rounds["a"]] == pytest.approx([10.0, 5.0])
    assert [p for _, p in rounds["a"]] == [1e9, 2e9]
    assert [p for _, p in rounds["llama"]] == [1e9, 2e9]
    assert sorted(readings) == [1e9, 1e9, 1e9, 2e9, 2e9, 2e9]
    text = e2e_cpu.render_paired(rounds, {"a": 1e9, "llama": 2e9})
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 7.5 (5.0-10.0) | 1.00 (1.00-1.00) | 6.25 (2.50-10.00) |" in rows["a"]  # shares 10 and 2.5
    assert "| 20.0 (20.0-20.0) | 3.00 (2.00-4.00) | - |" in rows["b"]  # no bytes known for b
    assert "| 15.0 (12.0-18.0) | 2.40 (1.20-3.60) | 21.00 (18.00-24.00) |" in rows["llama"]


def test_e2e_foreign_load_counts_the_children_it_waited_for_as_its_own():
    """llama-bench runs as a child of e2e_cpu's process: its CPU time is the benchmark's own, not
    "other processes'" (the e2e tables said 17-23% of the CPU time was foreign in runs with
    llama-bench sides on a quiet machine)."""
    import subprocess
    import sys

    import e2e_cpu

    load = e2e_cpu.ForeignLoad()
    before = load._own_busy_s()
    burn = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
            "print(time.process_time())")
    child_cpu = float(subprocess.run([sys.executable, "-c", burn], capture_output=True, text=True, check=True).stdout)
    assert load._own_busy_s() - before >= 0.8 * child_cpu


def test_graph_python_stubs_every_kernel_in_call_order_and_restores_them():
    """graph_python.measure times the graph with its kernels and then with stubs that return what
    each kernel call gave on a recording call, in call order (so the graph's own code sees the
    same values), and puts the real kernels back, also when the graph raises."""
    import graph_python

    calls = []

    def kernel(x):
        calls.append(x)
        return x + 1

    scope = {"dlinfer_kernel": kernel, "torch": torch}
    exec("def graph(x):\n    y = dlinfer_kernel(x)\n    z = dlinfer_kernel(y * 10)\n    return z", scope)
    graph = scope["graph"]
    assert graph_python.kernel_names(scope) == ["dlinfer_kernel"]
    results = graph_python.measure(graph, (1,), rounds=2, calls=3)
    assert [r[2] for r in results] == [2, 2]  # two kernel calls a graph call
    # the kernel ran only in the warm-up (3 graph calls) and, each round, on the real side (3) and
    # in the recording call (1): two kernel calls a graph call; the stubbed calls never reach it
    assert len(calls) == 2 * (3 + 2 * (3 + 1))
    assert scope["dlinfer_kernel"] is kernel and graph(1) == 21

    class PerSize:  # a graph compiled per batch size (dlinfer/graph/specialize.py): called as it is,
        def graph_for(self, *args):  # its kernels found in the copy its arguments run
            return graph

        def __call__(self, *args):
            return graph(*args)

    calls.clear()
    assert [r[2] for r in graph_python.measure(PerSize(), (1,), rounds=1, calls=3)] == [2]
    assert len(calls) == 2 * (3 + 3 + 1) and scope["dlinfer_kernel"] is kernel

    def failing(x):
        raise RuntimeError("the kernel under test failed")

    scope["dlinfer_kernel"] = failing
    with pytest.raises(RuntimeError, match="the kernel under test failed"):
        graph_python.measure(graph, (1,), rounds=1, calls=1)
    assert scope["dlinfer_kernel"] is failing
