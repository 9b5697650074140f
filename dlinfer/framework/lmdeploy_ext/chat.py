"""`python -m dlinfer chat MODEL [options]`: a multi-turn chat with a model through LMDeploy's
PyTorch engine on a dlinfer device type (default: cpu), in the terminal or from a script.

- The conversation is a list of messages (an optional `--system` message, then user and
  assistant turns), formatted by the model's chat template each turn (LMDeploy's pipeline does
  that: `pipeline.stream_infer(messages, ...)`, as `lmdeploy chat` does); the answer streams to
  stdout as it is generated.
- After each answer one line goes to stderr: prompt tokens, new tokens, time to first token and
  decode tokens/s (so a script reading stdout gets the answers alone).
- Commands, alone on a line: `/reset` forgets the conversation (the system message stays),
  `/exit` (or `/quit`) ends, `/help` lists them. Ctrl-D (end of input) ends too; Ctrl-C while an
  answer streams stops that answer and drops its turn, at the prompt it ends the chat.
- A terminal gets a `>>> ` prompt; other input (a pipe, a file) is read one turn per line, with
  no prompt, so a chat can be scripted.
- Decoding defaults to sampling with the model's generation config (as `lmdeploy chat`);
  `--greedy` decodes greedily (the same answers every run).
- MODEL must be a local HF folder the engine runs (float or quantised); a folder that is not one,
  or a setting the device cannot run, is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional, TextIO

PROG = "python -m dlinfer chat"  # its options: dlinfer/__main__.py (parsing them patches nothing)
COMMANDS = {"/reset": "forget the conversation (the system message stays)", "/exit": "end the chat",
            "/quit": "end the chat", "/help": "this list"}


def engine_config(args: argparse.Namespace):
    """The PytorchEngineConfig of the chat's engine (the device's defaults for the rest)."""
    from lmdeploy import PytorchEngineConfig

    config = dict(device_type=args.device, dtype=args.dtype, eager_mode=not args.graph, tp=args.tp,
                  max_batch_size=1, enable_metrics=False)
    if args.session_len is not None:
        config["session_len"] = args.session_len
    return PytorchEngineConfig(**config)


def generation_config(args: argparse.Namespace):
    from lmdeploy import GenerationConfig

    config = dict(max_new_tokens=args.max_new_tokens, do_sample=not args.greedy)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    return GenerationConfig(**config)


class Chat:
    """The conversation and one engine: `answer(text, out)` streams a reply and keeps the turn."""

    def __init__(self, pipe, gen_config, system: Optional[str]):
        self.pipe, self.gen_config, self.system = pipe, gen_config, system
        self.messages: List[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def answer(self, text: str, out: TextIO) -> dict:
        """Stream the model's reply to `text` (with the conversation so far) into `out`; returns
        {prompt_tokens, new_tokens, ttft_s, decode_tok_s, finish_reason}. The turn is kept only
        when the reply completes (Ctrl-C: the engine stops it and the turn is dropped)."""
        request = [*self.messages, {"role": "user", "content": text}]
        session = self.pipe.session()
        start = time.perf_counter()
        first = last = None
        reply, new_tokens, prompt_tokens, finish = "", 0, 0, None
        try:
            for chunk in self.pipe.stream_infer([dict(m) for m in request], sessions=session,
                                                gen_config=self.gen_config, stream_response=True,
                                                sequence_start=True, sequence_end=True):
                now = time.perf_counter()
                if chunk.token_ids and first is None:
                    first = now
                last = now
                out.write(chunk.text)
                out.flush()
                reply += chunk.text
                new_tokens += len(chunk.token_ids or [])
                prompt_tokens = chunk.input_token_len or prompt_tokens
                finish = chunk.finish_reason or finish
        except KeyboardInterrupt:
            session.abort()
            out.write("\n")
            raise
        out.write("\n")
        out.flush()
        self.messages = [*request, {"role": "assistant", "content": reply}]
        rate = (new_tokens - 1) / (last - first) if new_tokens > 1 and last > first else float("nan")
        return dict(prompt_tokens=prompt_tokens, new_tokens=new_tokens, ttft_s=(first or last or start) - start,
                    decode_tok_s=rate, finish_reason=finish)


def speed_line(stats: dict) -> str:
    line = (f"[{stats['prompt_tokens']} prompt tokens, {stats['new_tokens']} new, first token after "
            f"{stats['ttft_s']:.2f} s, decode {stats['decode_tok_s']:.1f} tokens/s")
    if stats["finish_reason"] == "length":
        line += ", stopped at --max-new-tokens or the session length"
    return line + "]"


def _turns(stdin: TextIO, interactive: bool, err: TextIO):
    """The user's lines (stripped of the newline); ends at end of input."""
    while True:
        if interactive:
            err.write(">>> ")
            err.flush()
        line = stdin.readline()
        if not line:
            if interactive:
                err.write("\n")
            return
        yield line.rstrip("\n")


def converse(chat: Chat, stdin: TextIO, out: TextIO, err: TextIO, interactive: bool) -> int:
    """The chat loop over `stdin`'s lines; 0 at /exit or end of input."""
    for line in _turns(stdin, interactive, err):
        text = line.strip()
        if not text:
            continue
        command = text.split()[0].lower()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            chat.reset()
            err.write("[conversation reset]\n")
            continue
        if command == "/help":
            err.write("".join(f"  {name:<7} {what}\n" for name, what in COMMANDS.items()))
            continue
        if command.startswith("/") and command not in COMMANDS and " " not in text:
            err.write(f"unknown command {command!r} (/help lists them)\n")
            continue
        try:
            stats = chat.answer(text, out)
        except KeyboardInterrupt:
            err.write("[answer stopped; the turn is dropped]\n")
            continue
        err.write(speed_line(stats) + "\n")
        err.flush()
    return 0


def main(args: argparse.Namespace, stdin: TextIO = None, out: TextIO = None, err: TextIO = None) -> int:
    """Run the chat: 0 at its end, 2 (one line on stderr) for a MODEL the engine cannot load or a
    setting the device cannot run."""
    from dlinfer.framework.lmdeploy_options import check_chat_options

    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    try:  # what needs no LMDeploy first: a typo is refused before the adaptor's import (seconds)
        check_chat_options(args)
    except ValueError as exc:
        err.write(f"{PROG}: error: {exc}\n")
        return 2
    import dlinfer.framework.lmdeploy_ext  # noqa: F401  (adds dlinfer's device types to LMDeploy)
    from dlinfer.framework.lmdeploy_ext.serve import check_model_here

    try:
        check_model_here(argparse.Namespace(model_path=args.model, device=args.device))
        config = engine_config(args)
        gen_config = generation_config(args)
    except ValueError as exc:
        err.write(f"{PROG}: error: {exc}\n")
        return 2
    from lmdeploy import pipeline

    interactive = stdin.isatty()
    if interactive:
        err.write(f"[loading {args.model} on {args.device} ...]\n")
    start = time.perf_counter()
    try:
        pipe = pipeline(args.model, backend_config=config, log_level="ERROR")
    except (ValueError, RuntimeError, OSError) as exc:  # a setting or model refused, a vendor error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        err.write(f"{PROG}: error: {type(exc).__name__}: {first}\n")
        return 2
    try:
        if interactive:
            err.write(f"[ready in {time.perf_counter() - start:.1f} s; /help lists the commands, Ctrl-D ends]\n")
        try:
            return converse(Chat(pipe, gen_config, args.system), stdin, out, err, interactive)
        except KeyboardInterrupt:
            err.write("\n")
            return 0
    finally:
        pipe.close()
