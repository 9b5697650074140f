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
  by its load-time hook, column_tiled or k_interleaved, as the engine does), group 64 (1536 -> 576: also 64, as the
  AWQ checkpoints of docs/quantize.md; `--groups 64,32` adds a side per group size), float32 activations;
- W8A8: the cpu vendor's `linear_w8a8` on int8 activations and weights, float32 output.
GB/s counts every byte a call must read: packed weight, scales and zero points. A reference side
sums each packed W4A16 weight with torch (120 `sum` calls a step, same tensors). The read
bandwidth is a float32 sum over 512 MB (or over the largest side's weights in all copies, if
larger), measured in the same run.

A machine whose last-level cache holds a step's weights (the Intel Xeon VM of docs/benchmarks.md:
480 MB of L3) serves them from the cache, not memory: `--copies N` gives each side N copies of its
weights, step i on copy i mod N, so that with N x the step's bytes beyond the cache every step
streams from memory. `--huge-pages` moves the weights and the sum's tensor onto 2 MB pages
(dlinfer/utils/huge_pages.py), as the LMDeploy adaptor does with a model's weights.
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


def cycled(copies: list[list[tuple]], fn, *tail):
    """A step function that calls fn(*call, *tail) for the calls of copy i mod len(copies) at its
    i-th call."""
    state = {"i": 0}

    def step():
        calls = copies[state["i"] % len(copies)]
        state["i"] += 1
        for call in calls:
            fn(*call, *tail)

    return step


def w4_calls(group: int, g: torch.Generator, hot: bool = False) -> tuple[list[tuple], int]:
    """(calls, bytes they read): the 120 W4A16 calls' arguments at `group` rows per group, M = 1;
    hot: every layer calls the first layer's weights (0.4-1 MB each: from the caches, not memory)."""
    import dlinfer.ops as ops
    from dlinfer.vendor import w4_layouts as L

    calls, nbytes, first_layer_bytes = [], 0, 0
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
    return calls, nbytes


def w4_step(group: int, hot: bool = False, copies: int = 1):
    """(step function, bytes a step reads, tensors): the 120 W4A16 calls in `copies` copies."""
    from dlinfer.vendor import selection

    g = torch.Generator().manual_seed(0)
    made = [w4_calls(group, g, hot) for _ in range(1 if hot else copies)]
    fn = selection.resolve("weight_quant_matmul", "cpu")[0]
    return cycled([c for c, _ in made], fn, None, group), made[0][1], [t for c, _ in made for call in c for t in call]


def w8a8_calls(g: torch.Generator) -> tuple[list[tuple], int]:
    """(calls, bytes they read): the 120 W8A8 calls' arguments, M = 1."""
    calls, nbytes = [], 0
    for _ in range(LAYERS):
        for k, n in SHAPES:
            weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scale = torch.rand(n, generator=g)
            x = torch.randint(-127, 128, (1, k), generator=g, dtype=torch.int8)
            calls.append((x, weight, torch.rand(1, generator=g), scale))
            nbytes += weight.numel() + scale.numel() * 4
    return calls, nbytes


def w8a8_step(copies: int = 1):
    """(step function, bytes a step reads, tensors): the 120 W8A8 calls in `copies` copies."""
    from dlinfer.vendor import selection

    g = torch.Generator().manual_seed(1)
    made = [w8a8_calls(g) for _ in range(copies)]
    fn = selection.resolve("linear_w8a8", "cpu")[0]
    tensors = [t for c, _ in made for call in c for t in call]
    return cycled([c for c, _ in made], fn, torch.float32, None), made[0][1], tensors


def weight_sums(copies: list[torch.Tensor], n: int):
    """(step function, bytes a step reads, tensors): a float32 `sum` over each of the first side's
    packed weights, one call each, in the same order and copies: the rate torch's own stream
    reaches on the same 120 tensors (their sizes, their calls' fixed costs), a reference beside
    the one large sum."""
    views = [t.view(torch.float32) for t in copies]
    per_copy = [views[i:i + n] for i in range(0, len(views), n)]
    return cycled([[(v,) for v in c] for c in per_copy], torch.sum), sum(v.numel() * 4 for v in per_copy[0]), []


def sum_bandwidth(nbytes: int, huge: bool) -> float:
    """Bytes per second a float32 sum over `nbytes` reads (on 2 MB pages if `huge`)."""
    from bench_cpu_ops import timeit

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    if huge:
        from dlinfer.utils.huge_pages import move_to_huge_pages

        move_to_huge_pages([src])
    return nbytes / timeit(lambda: src.sum(), min_time=0.5)


def main(argv=None) -> int:
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
    parser.add_argument("--copies", type=int, default=1,
                        help="copies of each side's weights, cycled step by step (to read them from beyond the caches)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="the weights and the sum's tensor on 2 MB pages, as the LMDeploy adaptor puts a model's")
    args = parser.parse_args(argv)
    if args.copies < 1:
        parser.error(f"--copies must be >= 1, got {args.copies}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if "cpu" not in dlinfer.vendor.available():
        print("the cpu vendor does not load here", file=sys.stderr)
        return 1
    with dlinfer.vendor.using("cpu"):
        sides = {f"W4A16 g{group} (weight_quant_matmul)": w4_step(group, copies=args.copies)
                 for group in map(int, args.groups.split(","))}
        if args.hot:
            sides.update({f"W4A16 g{group}, weights hot in cache": w4_step(group, hot=True)
                          for group in map(int, args.groups.split(","))})
        sides["W8A8 (linear_w8a8)"] = w8a8_step(args.copies)
        if args.huge_pages:
            from dlinfer.utils.huge_pages import move_to_huge_pages

            for name, (_, _, tensors) in sides.items():
                report = move_to_huge_pages(tensors)
                print(f"{name}: {report.huge / 2**20:.0f} of {report.bytes / 2**20:.0f} MB on huge pages"
                      + (f" ({report.problem})" if report.problem else ""), file=sys.stderr)
        # after the move: its float32 views of the W4 weights must see the moved storages
        first_w4 = next(iter(sides.values()))[2]
        from dlinfer.vendor import w4_layouts

        packed = [t for t in first_w4 if w4_layouts.is_repacked(t)]  # the qweights, as the vendor's hook left them
        sides["reference: float32 sum of each W4A16 packed weight (torch.sum)"] = weight_sums(packed,
                                                                                               LAYERS * len(SHAPES))
        sum_bytes = max(512 << 20, max(nbytes for _, nbytes, _ in sides.values()) * args.copies)
        best = {name: float("inf") for name in sides}
        bandwidth = 0.0
        for r in range(args.rounds):
            bandwidth = max(bandwidth, sum_bandwidth(sum_bytes, args.huge_pages))
            for name, (step, _, _) in sides.items():
                for _ in range(5):
                    step()
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
                best[name] = min(best[name], statistics.median(times))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    pages = "2 MB pages" if args.huge_pages else "the allocator's pages"
    print(f"SmolLM2-135M decode step's quantised linears (120 calls, M = 1); CPU, {torch.get_num_threads()} threads; "
          f"{args.copies} {'copy' if args.copies == 1 else 'copies, cycled,'} of the weights; {pages}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(float32 sum over {sum_bytes / 2**20:.0f} MB, this machine, same run, best of {args.rounds})\n")
    print("| side | MB read per step | ms per step | us per call | GB/s | of read bandwidth |")
    print("|---|---|---|---|---|---|")
    for name, (_, nbytes, _) in sides.items():
        t = best[name]
        print(f"| {name} | {nbytes / 1e6:.1f} | {t * 1e3:.3f} | {t / (LAYERS * len(SHAPES)) * 1e6:.1f} | "
              f"{nbytes / t / 1e9:.1f} | {nbytes / t / bandwidth:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
