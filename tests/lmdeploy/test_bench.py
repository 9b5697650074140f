"""`python -m dlinfer bench` and the timing code it shares with benchmarks/e2e_cpu.py
(dlinfer/tools/decode_timing.py)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.engine_helpers import cpu_pipeline

from dlinfer.tools import decode_timing

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600


def _command(*args):
    return subprocess.run([sys.executable, "-m", "dlinfer", "bench", *map(str, args)], text=True,
                          capture_output=True, cwd=REPO, timeout=RUN_TIMEOUT_S)


def test_decode_rate_cancels_prefill_and_first_token():
    # 4 sequences, 10 new tokens in 1.9 s, 1 new token in 0.1 s: 4 * 9 tokens in 1.8 s
    assert decode_timing.decode_rate(4, 10, 1.9, 0.1) == pytest.approx(20.0)
    assert decode_timing.decode_rate(1, 10, 0.1, 0.1) != decode_timing.decode_rate(1, 10, 0.1, 0.1)  # NaN


def test_prompt_ids_have_the_asked_length(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    prompts = decode_timing.chat_prompts(tokenizer, 3)
    assert len(prompts) == 3 and prompts[0] == decode_timing.QUESTIONS[0]  # no chat template: the question itself
    first = tokenizer(prompts[0], add_special_tokens=False).input_ids
    for n in (1, 17, 300):
        ids = decode_timing.prompt_ids(tokenizer, n, prompts)
        assert len(ids) == n and ids[:5] == first[:min(n, 5)]


def test_generator_gives_exactly_n_greedy_tokens(model_dir):
    from lmdeploy import GenerationConfig

    with cpu_pipeline(model_dir("llama")) as pipe:
        run = decode_timing.generator(pipe)
        prompts = ["Answer small five by prefill eight", "Name three primary colors."]
        outs = run(2, 7, prompts=prompts)
        assert [len(o) for o in outs] == [7, 7]
        greedy = pipe(prompts, gen_config=GenerationConfig(max_new_tokens=7, do_sample=False, ignore_eos=True),
                      do_preprocess=False)
        assert outs == [list(g.token_ids) for g in greedy]
        ids = decode_timing.prompt_ids(pipe.async_engine.tokenizer.model.model, 40, prompts)
        assert len(run(1, 3, ids=ids)[0]) == 3


def test_step_bytes_leave_out_the_table_the_quantised_heads_do_not_read(model_dir, monkeypatch):
    """A tied model: its float head reads the embedding table, its int8 and int4 heads read their own
    copy (backend/lm_head.py keeps the table as the head's `weight`): the difference of the steps
    is the table's bytes less the int8 copy's and its row scales', or less the int4 head's
    buffers it reads."""
    folder = model_dir("llama_tied")
    steps, int4_bytes = {}, None
    for head in ("float", "int8", "int4"):
        monkeypatch.setenv("DLINFER_LM_HEAD", head)
        with cpu_pipeline(folder) as pipe:
            steps[head] = decode_timing.step_bytes(pipe)
            model = pipe.async_engine.engine.executor.model_agent.patched_model
            model = model.get_model() if hasattr(model, "get_model") else model
            embed = next(m.weight for n, m in model.named_modules() if n.endswith("embed_tokens"))
            table = embed.numel() * embed.element_size()
            if head == "int4":
                qweight = model.lm_head.qweight
                assert qweight.dim() == 3 and qweight.dtype in (torch.int32, torch.uint8)  # a vendor layout
                # k_interleaved (uint8) carries each group's scales and zero points in its stream
                buffers = (qweight,) if qweight.dtype == torch.uint8 else (qweight, model.lm_head.scales,
                                                                            model.lm_head.qzeros)
                int4_bytes = sum(t.numel() * t.element_size() for t in buffers)
    vocab, hidden = embed.shape
    assert steps["float"] - steps["int8"] == table - vocab * hidden - 4 * vocab
    assert steps["float"] - steps["int4"] == table - int4_bytes and int4_bytes < vocab * hidden


@pytest.mark.slow
def test_the_command_prints_one_row_per_engine_with_the_probe(model_dir):
    # 16 tokens, best of 2: T(N) - T(1) well above a busy machine's noise (6 tokens in one round, five
    # steps of a tiny model, failed once while the suite ran beside it; a rate within the noise can
    # come out <= 0 or NaN)
    run = _command(model_dir("llama"), "--mode", "eager", "--dtype", "float32,bfloat16", "--batch", "1,2",
                   "--new-tokens", 16, "--prompt-lengths", "16,40", "--repeats", 2)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| eager, ")]
    assert [r.split(" | ")[0] for r in rows] == ["| eager, float32", "| eager, bfloat16"], run.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        numbers = [float(c) for c in cells[1:]]  # 2 rates, 2 TTFTs, GB, GB/s, share: all measured
        assert len(numbers) == 7 and all(v > 0 for v in numbers[:-1]) and numbers[-1] >= 0, row  # a tiny model: ~0.01
    assert "share of the probe" in run.stdout and "no read-bandwidth probe" not in run.stdout
    for step in ("loading", "ready in", "round 2/2", "first token of a 16-token prompt"):
        assert step in run.stderr, step
    gb = [float(r.strip("|").split("|")[5]) for r in rows]
    assert gb[1] < 0.6 * gb[0]  # bfloat16 weights: about half of float32's bytes a step


def test_a_refusal_as_a_command_is_one_line_and_status_2():
    """The whole command (a process: nothing else reaches stderr); the other refusals in-process."""
    run = _command("/nonexistent/model")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, lines)
    assert re.match(r"python -m dlinfer bench: error: ", lines[0]) and "does not exist" in lines[0], lines


@pytest.mark.parametrize("args,message", [
    (("{model}", "--mode", "fast"), "--mode 'fast'"),
    (("{model}", "--batch", "0,8"), "--batch '0,8'"),
    (("{model}", "--new-tokens", "1"), "--new-tokens >= 2"),
    (("/nonexistent/model",), "does not exist"),
])
def test_refusals_are_one_line_and_status_2(model_dir, args, message):
    from dlinfer.__main__ import _build_parser
    from dlinfer.framework.lmdeploy_ext import bench

    parsed = _build_parser().parse_args(["bench", *[a.format(model=model_dir("llama")) for a in args]])
    out, err = io.StringIO(), io.StringIO()
    assert bench.main(parsed, out=out, err=err) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and re.match(r"python -m dlinfer bench: error: ", lines[0]) and message in lines[0], lines
    assert out.getvalue() == ""
