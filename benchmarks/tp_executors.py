"""Decode speed of tensor parallel through LMDeploy's mp executor against its Ray executor, on
device_type="cpu", each side in a process of its own, alternated. Three sides: `mp`; `ray`, dlinfer's
default, where a step's inputs and outputs go over a TCP connection to each rank
(framework/lmdeploy_ext/ray_steps.py); `ray-calls`, LMDeploy's own per-step put and actor calls
(DLINFER_RAY_STEP_CHANNEL=0).

    .venv/bin/python benchmarks/tp_executors.py [--model DIR] [--tp 2] [--tokens 128] [--rounds 3]

Each run builds a pipeline (eager steps) and times a greedy generation of `--tokens` tokens at
batch 1, after a warm-up generation; decode tokens/s = (tokens - 1) / (time - time to the first
token). The Ray side starts its own one-node cluster on the loopback address and shuts it down.
Prints every run and, per side, the min / median; the ratios to mp at the medians. Then Ray's
own fixed costs on this machine, measured in a process of their own with an idle actor: a
`ray.put` of a step's inputs, and an actor call's round trip with the put object as its argument
(LMDeploy's Ray executor makes one put and three calls a step: a forward per rank, the leader's
outputs); that is the floor of what the `ray-calls` side adds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_side(model: str, tp: int, backend: str, tokens: int) -> float:
    """Decode tokens/s of one generation in this process."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    config = PytorchEngineConfig(device_type="cpu", eager_mode=True, tp=tp, distributed_executor_backend=backend,
                                 max_batch_size=8, num_gpu_blocks=256)
    pipe = pipeline(model, backend_config=config, log_level="ERROR")
    try:
        gen = GenerationConfig(max_new_tokens=tokens, do_sample=False, ignore_eos=True)
        prompt = "The model reads the prompt and answers"
        pipe([prompt], gen_config=GenerationConfig(max_new_tokens=8, do_sample=False, ignore_eos=True))
        first = None
        count = 0
        for out in pipe.stream_infer([prompt], gen_config=gen, do_preprocess=False):
            count += len(out.token_ids)
            if first is None and count:
                first = time.perf_counter()
        return (count - 1) / (time.perf_counter() - first)
    finally:
        pipe.close()


def ray_call_costs(rounds: int = 300) -> dict:
    """Milliseconds of one `ray.put` of a small dict and of one awaited call of an idle async
    actor with that object as its argument (median of `rounds`), on a one-node cluster of its own."""
    import asyncio

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Idle:
            async def echo(self, x):
                return x

        actor = Idle.remote()
        inputs = {"input_ids": list(range(64)), "seq_length": [1], "is_decoding": True}
        ray.get(actor.echo.remote(ray.put(inputs)))

        async def timed() -> dict:
            puts, calls = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                ref = ray.put(inputs)
                put = time.perf_counter()
                await actor.echo.remote(ref)
                calls.append(time.perf_counter() - put)
                puts.append(put - start)
            return {"put_ms": statistics.median(puts) * 1e3, "call_ms": statistics.median(calls) * 1e3}

        return asyncio.run(timed())
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an HF folder (default: the tests' tiny Llama)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", default="mp,ray,ray-calls", help="comma-separated, from mp, ray, ray-calls")
    # one run, in a child
    parser.add_argument("--side", choices=("mp", "ray", "ray-calls", "ray-costs"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "ray-costs":
        print(json.dumps(ray_call_costs()))
        return 0
    if args.side:
        if args.side == "ray-calls":
            os.environ["DLINFER_RAY_STEP_CHANNEL"] = "0"
        backend = "mp" if args.side == "mp" else "ray"
        print(json.dumps(run_side(args.model, args.tp, backend, args.tokens)))
        return 0
    if args.model is None:
        sys.path.insert(0, str(REPO / "tests"))
        from support.tiny_models import tiny_model

        args.model = str(tiny_model("llama"))
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    sides = args.sides.split(",")
    if "mp" not in sides or not set(sides) <= {"mp", "ray", "ray-calls"}:
        parser.error(f"--sides: mp and any of ray, ray-calls; got {args.sides!r}")
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in (sides if round_ % 2 == 0 else sides[::-1]):
            out = subprocess.run([sys.executable, __file__, "--side", side, "--model", args.model, "--tp", str(args.tp),
                                  "--tokens", str(args.tokens)], env=env, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            rate = json.loads(out.stdout.strip().splitlines()[-1])
            rates[side].append(rate)
            print(f"round {round_ + 1} {side}: {rate:.1f} tokens/s", flush=True)
    med = {side: statistics.median(values) for side, values in rates.items()}
    for side, values in rates.items():
        print(f"{side}: min {min(values):.1f} / median {med[side]:.1f} tokens/s")
    for side in (s for s in sides if s != "mp"):
        print(f"{side} / mp at the medians: {med[side] / med['mp']:.3f}; per step: mp {1e3 / med['mp']:.1f} ms, "
              f"{side} {1e3 / med[side]:.1f} ms ({1e3 / med[side] - 1e3 / med['mp']:+.1f} ms)")
    out = subprocess.run([sys.executable, __file__, "--side", "ray-costs"], env=env, capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return 1
    costs = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Ray on this machine (idle actor, median): ray.put {costs['put_ms']:.2f} ms, a call's round trip "
          f"{costs['call_ms']:.2f} ms; one put and three calls a step: {costs['put_ms'] + 3 * costs['call_ms']:.1f} ms "
          "if none overlapped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
