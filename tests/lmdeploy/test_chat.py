"""`python -m dlinfer chat`: multi-turn chat through LMDeploy on device_type="cpu".

In-process (the `Chat` class on one pipeline): a greedy turn is the pipeline's own greedy answer
to the same messages, the history grows turn by turn, `/reset` gives the first turn back, a system
message is part of the prompt. As a command (a subprocess reading piped turns): answers on stdout,
a speed line per answer, the commands, end of input and `/exit`, and the one-line refusals.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.engine_helpers import cpu_pipeline

from dlinfer.framework.lmdeploy_ext import chat

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 12
# A prompt whose greedy answer on the tiny Llama decodes to whole characters (tests/lmdeploy/test_serve.py).
PROMPT = "Answer small five by prefill eight"
SPEED = re.compile(r"^\[(\d+) prompt tokens, (\d+) new, first token after [\d.]+ s, decode [\d.]+ tokens/s",
                   re.MULTILINE)
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def pipe(model_dir):
    with cpu_pipeline(model_dir("llama")) as p:
        yield p


def _greedy():
    from lmdeploy import GenerationConfig

    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)


def _turn(c: chat.Chat, text: str):
    out = io.StringIO()
    stats = c.answer(text, out)
    assert out.getvalue().endswith("\n")
    return out.getvalue()[:-1], stats


def test_a_turn_is_the_pipelines_answer_and_the_history_grows(pipe):
    want = pipe([[{"role": "user", "content": PROMPT}]], gen_config=_greedy())[0]
    c = chat.Chat(pipe, _greedy(), None)
    first, s1 = _turn(c, PROMPT)
    assert first == want.text and s1["new_tokens"] == NEW_TOKENS == len(want.token_ids)
    assert s1["prompt_tokens"] == want.input_token_len and s1["finish_reason"] == "length"
    second, s2 = _turn(c, PROMPT)
    assert [m["role"] for m in c.messages] == ["user", "assistant", "user", "assistant"]
    assert c.messages[1]["content"] == first and c.messages[3]["content"] == second
    assert s2["prompt_tokens"] > s1["prompt_tokens"] + NEW_TOKENS // 2  # the first turn is in the prompt
    c.reset()
    again, s3 = _turn(c, PROMPT)
    assert again == first and s3["prompt_tokens"] == s1["prompt_tokens"]


def test_the_system_message_starts_the_prompt_and_survives_reset(pipe):
    plain = chat.Chat(pipe, _greedy(), None)
    _, s_plain = _turn(plain, PROMPT)
    c = chat.Chat(pipe, _greedy(), "You answer in one short sentence.")
    _, s1 = _turn(c, PROMPT)
    assert s1["prompt_tokens"] > s_plain["prompt_tokens"]
    c.reset()
    assert c.messages == [{"role": "system", "content": "You answer in one short sentence."}]
    _, s2 = _turn(c, PROMPT)
    assert s2["prompt_tokens"] == s1["prompt_tokens"]


def _command(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", "dlinfer", "chat", *map(str, args)], input=stdin, text=True,
                          capture_output=True, cwd=REPO, timeout=RUN_TIMEOUT_S)


@pytest.mark.slow
def test_piped_turns_commands_and_exit(model_dir):
    """Turns from a pipe: two answers (the second after /reset: the same greedy answer), /help and an
    unknown command on stderr, /exit stops before the last line."""
    turns = f"{PROMPT}\n/help\n/bogus\n\n/reset\n{PROMPT}\n/exit\n{PROMPT}\n"
    run = _command(model_dir("llama"), "--greedy", "--max-new-tokens", NEW_TOKENS, stdin=turns)
    assert run.returncode == 0, run.stderr
    speeds = SPEED.findall(run.stderr)
    assert [int(new) for _, new in speeds] == [NEW_TOKENS, NEW_TOKENS], run.stderr
    assert speeds[0][0] == speeds[1][0]  # the same prompt after /reset
    answer = run.stdout[: len(run.stdout) // 2]
    assert run.stdout == answer * 2 and answer.endswith("\n") and answer.strip(), run.stdout
    assert "/reset" in run.stderr and "unknown command '/bogus'" in run.stderr and "[conversation reset]" in run.stderr
    assert ">>>" not in run.stderr  # no prompt when stdin is not a terminal


REFUSALS = [
    (("/nonexistent/model",), "does not exist"),
    (("{model}", "--device", "tpu"), "--device 'tpu'"),
    (("{model}", "--dtype", "int4"), "int4"),
]


def test_a_refusal_as_a_command_is_one_line_and_status_2():
    """The whole command (a process: nothing else reaches stderr); the other refusals in-process."""
    run = _command("/nonexistent/model", stdin=f"{PROMPT}\n")
    assert run.returncode == 2, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m dlinfer chat: error:"), lines
    assert "does not exist" in lines[0], lines
    assert run.stdout == ""


@pytest.mark.parametrize("args,message", REFUSALS)
def test_refusals_are_one_line_and_status_2(model_dir, args, message):
    from dlinfer.__main__ import _build_parser

    parsed = _build_parser().parse_args(["chat", *[a.format(model=model_dir("llama")) for a in args]])
    out, err = io.StringIO(), io.StringIO()
    assert chat.main(parsed, stdin=io.StringIO(f"{PROMPT}\n"), out=out, err=err) == 2, err.getvalue()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m dlinfer chat: error:") and message in lines[0], lines
    assert out.getvalue() == ""
