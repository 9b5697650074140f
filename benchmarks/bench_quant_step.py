"""The quantised linears of one SmolLM2-135M decode step, as the engine runs them: GB/s of weight
streamed against this machine's read bandwidth, same run.

    .venv/bin/python benchmarks/bench_quant_step.py [--threads N] [--rounds 5]

A step at batch 1 calls 120 linears (30 layers x qkv [576 -> 960], o [576 -> 576], gate_up
[576 -> 3072], down [1536 -> 576]) on 120 distinct weights: 53 MB of 4-bit weight (plus 3.75 MB of
scales, float16 as the cpu vendor's repack stores an AWQ checkpoint's, 0.9 MB of zero points at
group 64) or 106 MB of int8, more than the last-level
cache, so every call streams its weight from memory, and each call is short (0.2-1.8 MB), so its
start (dispatch, the parallel region, the first cache misses of each stream) counts as it does
in a real step. The sides, timed interleaved, best median of --rounds:
- W4A16: the cpu vendor's `weight_quant_matmul` (the function the graph binds; weights repacked
  column_tiled by its load-time hook, as the engine does), group 64 (1536 -> 576: also 64, as the
  AWQ checkpoints of docs/quantize.md; `--groups 64,32` adds a side per group size), float32 activations;
- W8A8: the cpu vendor's `linear_w8a8` on int8 activations and weights, float32 output.
GB/s counts every byte a call must read: packed weight, scales and zero points. The read
bandwidth is a float32 sum over 512 MB (bench_cpu_ops.read_bandwidth), measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N) of qkv, o, gate_up, down
LAYERS = 30
GROUPS = (64,)


def w4_step(group: int, hot: bool = False):
    """(step function, bytes it reads): the 120 W4A16 calls at `group` rows per group, M = 1; hot:
    every layer calls the first layer's weights (0.4-1 MB each: from the caches, not memory)."""
    import dlinfer.ops as ops
    from dlinfer.vendor import selection
    from dlinfer.vendor import w4_layouts as L

    fn = selection.resolve("weight_quant_matmul", "cpu")[0]
    calls, nbytes, first_layer_bytes = [], 0, 0
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        if hot and layer > 0:  # the first layer's calls again (bytes counted as read again)
            calls += calls[:len(SHAPES)]
            nbytes += first_layer_bytes
            continue
        for k, n in SHAPES:
            values = torch.randint(0, 16, (k, n), generator=g)
            zeros = torch.randint(0, 16, (k // group, n), generator=g)
            scale = (torch.rand(k // group, n, generator=g) * 0.02).half().float()  # AWQ's float16 values
            qweight, scale, offset = ops.repack_weight_quant(L.pack(values), scale, L.pack(zeros), group)
            calls.append((torch.randn(1, k, generator=g), qweight, scale, offset))
            nbytes += sum(t.numel() * t.element_size() for t in (qweight, scale, offset))
        first_layer_bytes = nbytes

    def step():
        for x, qweight, scale, offset in calls:
            fn(x, qweight, scale, offset, None, group)

    return step, nbytes


def w8a8_step():
    """(step function, bytes it reads): the 120 W8A8 calls, M = 1."""
    from dlinfer.vendor import selection

    fn = selection.resolve("linear_w8a8", "cpu")[0]
    calls, nbytes = [], 0
    g = torch.Generator().manual_seed(1)
    for _ in range(LAYERS):
        for k, n in SHAPES:
            weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scale = torch.rand(n, generator=g)
            x = torch.randint(-127, 128, (1, k), generator=g, dtype=torch.int8)
            calls.append((x, weight, torch.rand(1, generator=g), scale))
            nbytes += weight.numel() + scale.numel() * 4

    def step():
        for x, weight, rms_scale, scale in calls:
            fn(x, weight, rms_scale, scale, torch.float32, None)

    return step, nbytes


def main(argv=None) -> int:
    from bench_cpu_ops import read_bandwidth

    import dlinfer.vendor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best median is kept")
    parser.add_argument("--steps", type=int, default=50, help="steps timed per side and round")
    parser.add_argument("--groups", default=",".join(map(str, GROUPS)),
                        help="comma-separated W4A16 group sizes, one side each (default 64; 32 is q4_1's block)")
    parser.add_argument("--hot", action="store_true",
                        help="W4A16 also with every layer on the first layer's weights: the kernel from the caches, "
                             "its compute bound")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "cpu" not in dlinfer.vendor.available():
        print("the cpu vendor does not load here", file=sys.stderr)
        return 1
    with dlinfer.vendor.using("cpu"):
        sides = {f"W4A16 g{group} (weight_quant_matmul)": w4_step(group)
                 for group in map(int, args.groups.split(","))}
        if args.hot:
            sides.update({f"W4A16 g{group}, weights hot in cache": w4_step(group, hot=True)
                          for group in map(int, args.groups.split(","))})
        sides["W8A8 (linear_w8a8)"] = w8a8_step()
        best = {name: float("inf") for name in sides}
        bandwidth = 0.0
        for r in range(args.rounds):
            bandwidth = max(bandwidth, read_bandwidth())
            for name, (step, _) in sides.items():
                for _ in range(5):
                    step()
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
                best[name] = min(best[name], statistics.median(times))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"SmolLM2-135M decode step's quantised linears (120 calls, M = 1); CPU, {torch.get_num_threads()} threads; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s (float32 sum, this machine, same run, best of {args.rounds})\n")
    print("| side | MB read per step | ms per step | us per call | GB/s | of read bandwidth |")
    print("|---|---|---|---|---|---|")
    for name, (_, nbytes) in sides.items():
        t = best[name]
        print(f"| {name} | {nbytes / 1e6:.1f} | {t * 1e3:.3f} | {t / (LAYERS * len(SHAPES)) * 1e6:.1f} | "
              f"{nbytes / t / 1e9:.1f} | {nbytes / t / bandwidth:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
