"""Decode tokens/s of an LMDeploy pipeline on device_type="cpu" at tp=1 and tp>1, interleaved,
with the time each rank spends in collectives per decode step.

    python benchmarks/bench_tp_cpu.py [--model DIR] [--tp 3] [--rounds 2] [--tokens 64]

Each round builds a tp=1 pipeline, then a tp=N one, and for each: one greedy request of the same
prompt for 8 new tokens, then for 8 + `tokens`; decode tokens/s = tokens / (difference of the two
times), so prefill and request overhead cancel. In the rank processes (which import this file as
`__mp_main__`, multiprocessing spawn) every torch.distributed collective is timed and appended to
a log; the collective time per decode step is that rank's sum over the longer request, divided by
its steps. Batch 1, eager mode. Numbers vary with whatever else runs on the machine: compare
within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

LOG_ENV = "DLINFER_BENCH_TP_LOG"  # folder where ranks log their collectives
REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast")


def _time_collectives(folder: str) -> None:
    """In a rank: append '<start> <seconds> <name>' to <folder>/<pid>.log for every collective."""
    import torch.distributed as dist

    log = open(Path(folder) / f"{os.getpid()}.log", "a", buffering=1)

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.time()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            log.write(f"{start:.6f} {time.perf_counter() - t0:.9f} {name}\n")
            return out
        return call

    for name in COLLECTIVES:
        setattr(dist, name, timed(name, getattr(dist, name)))


if __name__ == "__mp_main__" and os.environ.get(LOG_ENV):
    _time_collectives(os.environ[LOG_ENV])


def _request_seconds(pipe, prompt: str, new_tokens: int) -> tuple[float, float, float]:
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, ignore_eos=True)
    start = time.time()
    out = pipe([prompt], gen_config=gen, do_preprocess=False)[0]
    end = time.time()
    assert len(out.token_ids) == new_tokens, out
    return end - start, start, end


def _collectives(folder: Path, start: float, end: float) -> dict[str, tuple[int, float]]:
    """pid -> (calls, seconds) of the collectives that started in [start, end]."""
    result = {}
    for log in folder.glob("*.log"):
        calls, seconds = 0, 0.0
        for line in log.read_text().splitlines():
            t, dur, _ = line.split()
            if start <= float(t) <= end:
                calls, seconds = calls + 1, seconds + float(dur)
        if calls:
            result[log.stem] = (calls, seconds)
    return result


def measure(model: str, tp: int, tokens: int, folder: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from support.engine_helpers import cpu_pipeline

    prompt = "Write a short story about a river that flows through a quiet city at night."
    with cpu_pipeline(model, tp=tp, max_batch_size=8) as pipe:
        _request_seconds(pipe, prompt, 8)  # warm
        short, _, _ = _request_seconds(pipe, prompt, 8)
        long, start, end = _request_seconds(pipe, prompt, 8 + tokens)
    per_rank = _collectives(folder, start, end)
    steps = 8 + tokens  # one prefill + the decode steps of the longer request
    return dict(tp=tp, tok_s=tokens / (long - short),
                ms_step=1e3 * (long - short) / tokens,
                coll_ms_step={pid: 1e3 * s / steps for pid, (c, s) in per_rank.items()},
                calls_step={pid: c / steps for pid, (c, s) in per_rank.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench_tp-"))
    os.environ[LOG_ENV] = str(folder)
    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    for r in range(args.rounds):
        for tp in (1, args.tp):
            res = measure(args.model, tp, args.tokens, folder)
            coll = ", ".join(f"{v:.1f}" for v in res["coll_ms_step"].values()) or "-"
            calls = ", ".join(f"{v:.1f}" for v in res["calls_step"].values()) or "-"
            print(f"round {r} tp={tp}: {res['tok_s']:.1f} decode tok/s ({res['ms_step']:.1f} ms/step); "
                  f"collectives per step, per rank: {coll} ms in {calls} calls", flush=True)


if __name__ == "__main__":
    main()
