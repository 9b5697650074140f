"""Time to first token under a burst: 32 long prompts sent at once to `python -m dlinfer serve`.

    .venv/bin/python benchmarks/ttft_burst.py                        # 8192 (LMDeploy's default) vs 512
    .venv/bin/python benchmarks/ttft_burst.py --chunks 8192 2048 512 --rounds 2 --prompt-tokens 256

For each prefill budget (`--max-prefill-token-num`, the tokens one prefill step may take) a
server is started on 127.0.0.1 with SmolLM2-135M-Instruct in float32 (scripts/smollm2.py),
eager mode, the CPU's default KV cache; after one warm-up request, `--requests` streaming chat
requests with distinct prompts of `--prompt-tokens` tokens each (chat template included) are
sent at once from as many threads, and each request's time to first token is the time from
its send to its first content chunk. Rounds alternate the budgets (A B A B ...) so that a busy
moment of the machine hits them alike. Prints, per budget: the median, the fastest and slowest
request's TTFT, the median of the per-round medians, and the time until the last request
finished.

Why it matters: LMDeploy admits waiting prompts into one prefill step up to the budget; every
prompt in that step gets its first token only when the whole step is done. With 8192 tokens a
burst of 32 x 256 tokens is one step: nobody gets a token before all of it is prefilled.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from smollm2 import build_smollm2  # noqa: E402

WORDS = ("river mountain city forest ocean window engine kernel device memory token cache block layer "
         "green blue quick slow bright dark first second last next model answer question prompt").split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(folder: Path, count: int, tokens: int) -> list[str]:
    """`count` distinct user messages whose chat-templated prompts have `tokens` tokens each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for i in range(count):
        words = [f"Request {i}:"]
        while True:
            text = " ".join(words)
            n = len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
            if n >= tokens:
                break
            words.append(WORDS[(i * 7 + len(words) * 3) % len(WORDS)])
        out.append(text)
    return out


class Server:
    def __init__(self, folder: Path, chunk: int, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(folder)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dlinfer", "serve", self.model, "--server-name", "127.0.0.1",
                 "--server-port", str(self.port), "--eager-mode", "--max-prefill-token-num", str(chunk),
                 "--log-level", "ERROR"], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "UVICORN_LOG_LEVEL": "warning"})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=5).read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("server did not start")

    def stream(self, content: str, max_tokens: int) -> tuple[float, float]:
        """(seconds to the first content chunk, seconds to the end of the answer)."""
        body = json.dumps(dict(model=self.model, messages=[{"role": "user", "content": content}], temperature=0,
                               max_tokens=max_tokens, stream=True)).encode()
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        start, first = time.perf_counter(), None
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                if first is None and line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    if delta.get("content"):
                        first = time.perf_counter() - start
        return first if first is not None else float("nan"), time.perf_counter() - start

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)


def burst(server: Server, contents: list[str], max_tokens: int) -> list[tuple[float, float]]:
    results: list = [None] * len(contents)
    gate = threading.Barrier(len(contents))

    def one(i):
        gate.wait()
        results[i] = server.stream(contents[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of processes `pids` and their children)."""
    import psutil

    t = psutil.cpu_times()
    total = t.user + t.system + t.nice + getattr(t, "irq", 0) + getattr(t, "softirq", 0)
    ours = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                c = p.cpu_times()
                ours += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return total, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8192, 512])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/dlinfer_ttft"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    import psutil
    import torch

    folder = build_smollm2()
    contents = prompts(folder, args.requests, args.prompt_tokens)
    print(f"machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"burst: {args.requests} requests x {args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens each")
    ttft: dict[int, list[float]] = {c: [] for c in args.chunks}
    round_medians: dict[int, list[float]] = {c: [] for c in args.chunks}
    last_done: dict[int, list[float]] = {c: [] for c in args.chunks}
    for r in range(args.rounds):
        for chunk in (args.chunks if r % 2 == 0 else list(reversed(args.chunks))):
            server = Server(folder, chunk, args.log_dir / f"server_{chunk}_{r}.log")
            try:
                server.stream("Hello", 4)  # warm-up
                pids = [os.getpid()]  # with its children: the server and its engine process
                before, wall0 = _cpu_seconds(pids), time.perf_counter()
                results = burst(server, contents, args.max_tokens)
                wall = time.perf_counter() - wall0
                after = _cpu_seconds(pids)
                others = ((after[0] - before[0]) - (after[1] - before[1])) / (wall * psutil.cpu_count())
            finally:
                server.stop()
            firsts = sorted(f for f, _ in results)
            ttft[chunk] += firsts
            round_medians[chunk].append(statistics.median(firsts))
            last_done[chunk].append(max(t for _, t in results))
            print(f"round {r} max_prefill_token_num={chunk}: TTFT median {statistics.median(firsts):.1f} s, "
                  f"min {firsts[0]:.1f} s, max {firsts[-1]:.1f} s; all done {last_done[chunk][-1]:.1f} s; "
                  f"other processes used {max(others, 0):.0%} of the CPU",
                  flush=True)
    print()
    print("| max_prefill_token_num | TTFT median (s) | median of round medians (s) | fastest (s) | slowest (s) "
          "| last answer done (s) |")
    print("|---|---|---|---|---|---|")
    for chunk in args.chunks:
        xs = sorted(ttft[chunk])
        print(f"| {chunk} | {statistics.median(xs):.1f} | {statistics.median(round_medians[chunk]):.1f} | "
              f"{xs[0]:.1f} | {xs[-1]:.1f} | {statistics.median(last_done[chunk]):.1f} |")


if __name__ == "__main__":
    main()
