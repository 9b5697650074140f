"""The weight-streaming kernels at real decode shapes, against the read-bandwidth probe measured
interleaved with them in this process.

    .venv/bin/python benchmarks/bench_weight_stream.py [--models 1b,3b,8b] [--kernels f32,bf16,w8a8,w4-ct,w4-ki]
        [--rows 1,4] [--rounds 5] [--linears qkv,o,gate_up,down,head] [--4k-pages] [--hot MB] [--threads T]
        [--streams 1,4]

Shapes: the linears LMDeploy runs per layer of Llama-3.2-1B (hidden 2048, MLP 8192, 32 / 8 heads
of 64), Llama-3.2-3B (3072, 8192, 24 / 8 of 128) and Llama-3-8B (4096, 14336, 32 / 8 of 128):
qkv and gate_up merged as LMDeploy merges them, o, down, and the 128256-token LM head. Each side
is one linear kind of one model with one kernel at M rows, called on distinct copies of its weight
in turn until at least `--bytes` (default: 1 GiB or 2.5x the last-level cache, whichever is more)
are read, so every call streams from memory as in a decode step (the whole model's weights are
larger than the cache), on 2 MB pages as the engine puts them (`--4k-pages`: the allocator's).

Kernels (the cpu vendor's functions, as the engine calls them):
- f32 / bf16: `linear` (the few-row weight-streaming kernels, float32 and bf16 weights);
- w8a8: `linear_w8a8` (int8 weights, per-row scales, int8 activations; also the int8 LM head);
- w4-ct / w4-ki: `weight_quant_matmul` on column_tiled / k_interleaved weights (group 128,
  bfloat16 activations as a bf16 checkpoint's model runs them, `--w4-activations float32` for a
  float32 model's; k_interleaved only where the CPU has AVX-512 VNNI; past the build's
  register-kernel limit, 128 rows on AVX2 and 4096 on AVX-512, column_tiled calls time the
  dequantise + BLAS path, as the engine would run them);
- w4-a8: the k_interleaved kernel with 8-bit activations (path 4, what
  DLINFER_CPU_W4_ACTIVATIONS=int8 runs; AVX-512 VNNI, or AVX2 alone);
- w4-a16: the k_interleaved kernel with 16-bit activations (path 5, what a bfloat16 W4 model runs
  by default on an AVX2 build; AVX2 builds only).
GB/s counts every byte a call must read (weights, scales, zero points).

`--hot MB` asks what a kernel reads when memory is not the limit: each side's weight is cut to about
MB (fewer output rows N, a whole number of the layout's column tiles, at least one: so a side with a
long K can pass MB) and that one copy is called again and again, so it stays in cache (2 MB: each
thread's half in its 1 MB L2 on the Zen 5 VM; 12 MB: the L3). Its rate is the kernel's approximate
ceiling at that M (the cut shape's fixed cost per call, and a cut that fills L2, can put it a little
under what memory gives): at or below 0.85 of the probe the loop alone keeps the kernel under 85%;
above it, what is missing is the overlap of loop and stream (docs/notes/cpu-ops.md, "Several rows:
the loop's own ceiling"). The step table then weighs each side's rate by its uncut bytes. `--threads
T` runs the kernels on T threads (the probe keeps its explored configuration).

`--streams 1,4` compares the kernels' weight streams a thread (csrc/few_rows_walk.h,
`weight_streams`; DLINFER_CPU_WEIGHT_STREAMS): every side is timed under each setting in turn
within each round (the order reversed every other round), and the tables give one row per setting
(`kernel@streams`). Only the few-row linears and the int8 GEMV read the setting.

Each round times the probe (`ReadProbe.measure`, its best configuration explored once at the
start), then one pass of the side, then the probe again; a side's share is its rate over the mean
of the probe readings around it. The table gives per side the min / median time of a call, the
rate at the median, the probe's median and the share (median of the rounds' shares; best round in
brackets). The last rows per model and kernel weigh the linears as a decode step does (16 / 28 /
32 layers plus the head): the step's share of the probe.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Tuple

import torch

GROUP = 128  # 64 where it does not divide K (SmolLM2's 576: its AWQ checkpoints use 64)


def group_for(k: int) -> int:
    return GROUP if k % GROUP == 0 else 64


class Model(NamedTuple):
    hidden: int
    mlp: int
    q_heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int

    def linears(self) -> Dict[str, Tuple[int, int]]:
        """name -> (K, N) of the linears of one layer and the head."""
        h, d = self.hidden, self.head_dim
        return {"qkv": (h, (self.q_heads + 2 * self.kv_heads) * d), "o": (self.q_heads * d, h),
                "gate_up": (h, 2 * self.mlp), "down": (self.mlp, h), "head": (h, self.vocab)}


MODELS = {
    "smollm2": Model(576, 1536, 9, 3, 64, 30, 49152),  # SmolLM2-135M: small calls, where fixed costs show
    "1b": Model(2048, 8192, 32, 8, 64, 16, 128256),
    "3b": Model(3072, 8192, 24, 8, 128, 28, 128256),
    "8b": Model(4096, 14336, 32, 8, 128, 32, 128256),
}
KERNELS = ("f32", "bf16", "w8a8", "w4-ct", "w4-ki", "w4-a8", "w4-a16")
KI_KERNELS = ("w4-ki", "w4-a8", "w4-a16")  # the sides on k_interleaved weights


def side_runs(kernel: str) -> bool:
    """Whether this build and CPU run the kernel of side `kernel` (w4-ki: AVX-512 VNNI; w4-a8: VNNI
    or an AVX2 build; w4-a16: an AVX2 build; the others everywhere the cpu vendor loads)."""
    from dlinfer.vendor.cpu import weight_quant as wq

    return {"w4-ki": wq.VNNI, "w4-a8": wq.INT8_ACTIVATIONS, "w4-a16": wq.INT16_ACTIVATIONS}.get(kernel, True)


def _default_bytes() -> int:
    from dlinfer.utils import machine

    return max(1 << 30, int(2.5 * (machine.last_level_cache_bytes() or 0)))


def make_weights(kernel: str, k: int, n: int, target: int, g: torch.Generator, copies: int = 0):
    """(weights, bytes one call reads): distinct copies of one [N, K] weight as `kernel` reads it
    (each a tuple of tensors), enough of them for `target` bytes (or `copies` of them)."""
    if kernel in ("f32", "bf16"):
        dtype = torch.float32 if kernel == "f32" else torch.bfloat16
        first = ((torch.randn(n, k, generator=g) * 0.02).to(dtype),)
    elif kernel == "w8a8":
        first = (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g))
    else:
        from dlinfer.vendor import w4_layouts as L
        from dlinfer.vendor.cpu import weight_quant as wq

        q = L.pack(torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32))
        group = group_for(k)
        zeros = L.pack(torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32))
        scale = (torch.rand(k // group, n, generator=g) * 0.02).half()
        first = (wq.k_interleaved(q, scale, zeros, group) if kernel in KI_KERNELS else wq.column_tiled(q), scale,
                 zeros)
    nbytes = sum(t.numel() * t.element_size() for t in (first[:1] if kernel in KI_KERNELS else first))
    copies = copies or max(1, -(-target // nbytes))
    return [first] + [tuple(t.clone() for t in first) for _ in range(copies - 1)], nbytes


def make_calls(kernel: str, weights, m: int, k: int, g: torch.Generator,
               w4_activations: torch.dtype = torch.bfloat16) -> List[Callable]:
    """One call per weight copy: the cpu vendor's function for `kernel` on m rows of activations
    (w4_activations: the W4A16 sides' activation dtype)."""
    from dlinfer.vendor import selection

    x32 = torch.randn(m, k, generator=g)
    if kernel in ("f32", "bf16"):
        fn = selection.resolve("linear", "cpu")[0]
        x = x32.to(weights[0][0].dtype)
        return [(lambda w=w: fn(x, w[0], None)) for w in weights]
    if kernel == "w8a8":
        fn = selection.resolve("linear_w8a8", "cpu")[0]
        x, xs = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8), torch.rand(m, generator=g)
        return [(lambda w=w: fn(x, w[0], xs, w[1], torch.float32, None)) for w in weights]
    x = x32.to(w4_activations)
    if kernel in ("w4-a8", "w4-a16"):
        from dlinfer.vendor.cpu import weight_quant as wq

        path = wq.INT8_PATH if kernel == "w4-a8" else wq.INT16_PATH
        return [(lambda w=w: wq._w4_matmul_k_interleaved(x, w[0], w[1], w[2], None, group_for(k), path))
                for w in weights]
    fn = selection.resolve("weight_quant_matmul", "cpu")[0]
    return [(lambda w=w: fn(x, w[0], w[1], w[2], None, group_for(k))) for w in weights]


class Result(NamedTuple):
    min_s: float
    median_s: float
    rate: float  # bytes/s at the median
    probe: float  # the probe's median (bytes/s)
    share: float  # median of the rounds' shares
    best_share: float


def measure(calls: List[Callable], nbytes: int, probe, rounds: int, settings=(None,)) -> Dict[object, Result]:
    """Rounds of: probe, one pass over `calls` (each timed), probe; with several `settings` (weight
    streams a thread), one such pass per setting in each round, the order reversed every other
    round; the setting in force before comes back after, also when a call raises. Returns
    setting -> Result."""
    def apply(setting):
        if setting is not None:
            torch.ops.dlinfer_cpu.set_weight_streams(setting)

    in_force = torch.ops.dlinfer_cpu.weight_streams() if settings != (None,) else None
    times = {s: [] for s in settings}
    probes = {s: [] for s in settings}
    shares = {s: [] for s in settings}
    try:
        for setting in settings:
            apply(setting)
            for c in calls[:3]:
                c()  # first-call costs (pool, page tables of the output) out of the timings
        for r in range(rounds):
            for setting in (settings if r % 2 == 0 else settings[::-1]):
                apply(setting)
                before = probe.measure()
                start = time.perf_counter()
                per_call = []
                for c in calls:
                    t0 = time.perf_counter()
                    c()
                    per_call.append(time.perf_counter() - t0)
                rate = nbytes * len(calls) / (time.perf_counter() - start)
                after = probe.measure()
                times[setting] += per_call
                probes[setting] += [before, after]
                shares[setting].append(rate / ((before + after) / 2))
    finally:  # back to the setting in force before, whatever happened
        if in_force is not None:
            torch.ops.dlinfer_cpu.set_weight_streams(in_force)
    out = {}
    for setting in settings:
        med = statistics.median(times[setting])
        out[setting] = Result(min(times[setting]), med, nbytes / med, statistics.median(probes[setting]),
                              statistics.median(shares[setting]), max(shares[setting]))
    return out


def main(argv=None) -> int:
    import dlinfer.vendor
    from dlinfer.utils.huge_pages import move_to_huge_pages
    from dlinfer.vendor.cpu import read_probe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b,3b,8b", help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {','.join(KERNELS)}")
    parser.add_argument("--linears", default="qkv,o,gate_up,down,head", help="comma-separated linear kinds")
    parser.add_argument("--rows", default="1,4", help="comma-separated M (tokens per call)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bytes", type=float, default=None, help="GB read per pass of a side (default: see above)")
    parser.add_argument("--w4-activations", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the W4A16 sides' activation dtype (default: bfloat16, as a bf16 checkpoint runs)")
    parser.add_argument("--hot", type=float, default=None, metavar="MB",
                        help="the kernels' ceiling from cache: each weight cut to at most MB, one copy called again")
    parser.add_argument("--threads", type=int, default=None, help="threads for the kernels (default: torch's)")
    parser.add_argument("--4k-pages", dest="small_pages", action="store_true",
                        help="leave the weights on the allocator's pages (default: moved onto 2 MB pages)")
    parser.add_argument("--streams", default=None,
                        help="comma-separated weight streams a thread (1, 2, 4) to alternate on every side")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    kernels = [k for k in args.kernels.split(",") if k]
    for name in models:
        if name not in MODELS:
            parser.error(f"--models: {name!r} is not one of {', '.join(MODELS)}")
    for name in kernels:
        if name not in KERNELS:
            parser.error(f"--kernels: {name!r} is not one of {', '.join(KERNELS)}")
    for name in KI_KERNELS:
        if name in kernels and not side_runs(name):
            print(f"{name} skipped: this build does not run it (w4-ki needs AVX-512 VNNI, w4-a8 VNNI or an AVX2 "
                  "build, w4-a16 an AVX2 build)", file=sys.stderr)
            kernels.remove(name)
    if "cpu" not in dlinfer.vendor.available():
        print("the cpu vendor does not load here", file=sys.stderr)
        return 1
    settings = (None,)
    if args.streams:
        settings = tuple(int(v) for v in args.streams.split(",") if v)
        if not settings or any(v not in (1, 2, 4) for v in settings):
            parser.error(f"--streams: expected a list of 1, 2 and 4, got {args.streams!r}")
    target = int(args.bytes * 1e9) if args.bytes else _default_bytes()
    rows = [int(r) for r in args.rows.split(",")]
    probe = read_probe.ReadProbe()
    exploration = probe.explore()
    print(f"read-bandwidth probe: {read_probe.summary(exploration)}", file=sys.stderr, flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    results: Dict[tuple, Tuple[Result, int]] = {}
    with dlinfer.vendor.using("cpu"):
        for mname in models:
            model = MODELS[mname]
            for kernel in kernels:
                for lname in args.linears.split(","):
                    k, n = shape(model, lname, kernel, args.hot)
                    weights, nbytes = make_weights(kernel, k, n, target, g, copies=1 if args.hot else 0)
                    if not args.small_pages:
                        move_to_huge_pages([t for w in weights for t in w])
                    for m in rows:
                        calls = make_calls(kernel, weights, m, k, g, getattr(torch, args.w4_activations))
                        if args.hot:  # the one copy, called until a pass has read `target` bytes
                            calls = calls * max(1, target // nbytes)
                        for setting, res in measure(calls, nbytes, probe, args.rounds, settings).items():
                            label = kernel if setting is None else f"{kernel}@{setting}"
                            results[(mname, label, lname, m)] = (res, nbytes)
                            print(f"{mname} {label} {lname} [{k} -> {n}] M={m}: {res.rate / 1e9:.1f} GB/s, "
                                  f"{res.share:.2f} of the probe", file=sys.stderr, flush=True)
                    del weights
    labels = [k if s is None else f"{k}@{s}" for k in kernels for s in settings]
    report(results, models, labels, rows, exploration, target, args)
    return 0


BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "w8a8": 1.0, "w4-ct": 0.5, "w4-ki": 0.5, "w4-a8": 0.5, "w4-a16": 0.5}
# the 4-bit layouts store N in tiles of this many columns
COLUMN_TILE = {"w4-ct": 128, "w4-ki": 64, "w4-a8": 64, "w4-a16": 64}


def shape(model: Model, lname: str, kernel: str, hot_mb) -> Tuple[int, int]:
    """(K, N) of a side: the model's, or with `hot_mb` N cut to a multiple of the layout's column
    tile (64 for the dense kernels) so the weight takes at most that many MB (at least one tile).
    kernel: a side's kernel, or its label `kernel@streams`."""
    kernel = kernel.split("@")[0]
    k, n = model.linears()[lname]
    if hot_mb:
        tile = COLUMN_TILE.get(kernel, 64)
        n = min(n, max(tile, int(hot_mb * 1e6 / (k * BYTES_PER_WEIGHT[kernel])) // tile * tile))
    return k, n


def report(results, models, kernels, rows, exploration, target, args) -> None:
    from dlinfer.vendor.cpu import read_probe

    pages = "the allocator's pages" if args.small_pages else "2 MB pages"
    source = (f"one copy of at most {args.hot:g} MB per side called again (from cache), {target / 1e9:.2f} GB a pass"
              if args.hot else f">= {target / 1e9:.2f} GB of distinct copies per side")
    print(f"Weight-streaming kernels (cpu vendor), {torch.get_num_threads()} threads, weights on {pages}, "
          f"{source}; probe: {read_probe.summary(exploration)}; {args.rounds} rounds\n")
    print("| model | kernel | linear [K -> N] | M | MB / call | us / call (min / median) | GB/s | probe GB/s | share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (mname, kernel, lname, m), (res, nbytes) in results.items():
        k, n = shape(MODELS[mname], lname, kernel, args.hot)
        print(f"| {mname} | {kernel} | {lname} [{k} -> {n}] | {m} | {nbytes / 1e6:.1f} | {res.min_s * 1e6:.0f} / "
              f"{res.median_s * 1e6:.0f} | {res.rate / 1e9:.1f} | {res.probe / 1e9:.1f} | {res.share:.2f} "
              f"({res.best_share:.2f}) |")
    cut = " (each cut side's time scaled to the whole linear: the step's ceiling from cache)" if args.hot else ""
    print(f"\nA decode step's linears, weighted as the model calls them (layers x qkv, o, gate_up, down + head)"
          f"{cut}:\n")
    print("| model | kernel | M | GB a step | ms a step (at the medians) | GB/s | share of the probe |")
    print("|---|---|---|---|---|---|---|")
    for mname in models:
        model = MODELS[mname]
        for kernel in kernels:
            for m in rows:
                parts = [(lname, results.get((mname, kernel, lname, m))) for lname in model.linears()]
                if any(r is None for _, r in parts):
                    continue
                weight = {lname: (1 if lname == "head" else model.layers) for lname, _ in parts}
                # a cut side (--hot) stands for the whole linear: its time scaled by the uncut rows
                scale = {lname: model.linears()[lname][1] / shape(model, lname, kernel, args.hot)[1]
                         for lname, _ in parts}
                nbytes = sum(weight[lname] * scale[lname] * nb for lname, (_, nb) in parts)
                secs = sum(weight[lname] * scale[lname] * r.median_s for lname, (r, _) in parts)
                probe = statistics.median(r.probe for _, (r, _) in parts)
                print(f"| {mname} | {kernel} | {m} | {nbytes / 1e9:.2f} | {secs * 1e3:.1f} | "
                      f"{nbytes / secs / 1e9:.1f} | "
                      f"{nbytes / secs / probe:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
