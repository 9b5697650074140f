"""Long-context decode with a sliding window against the same decode without one, on one vendor.

    .venv/bin/python benchmarks/bench_window_decode.py [--vendor cpu] [--dtype bfloat16] [--rounds 5]
        [--contexts 4096,16384,32768] [--windows 1024,4096]

`paged_decode_attention` at Llama-3-8B's heads (Hq 32, Hkv 8, D 128), batch 1, 64-token blocks in
random order: each window and the no-window call alternate in every round (same process, same
cache); per case the median and min over rounds, and the speed-up over no window. A kernel that
reads only the blocks inside the window speeds up by about context / window (less the fixed cost
of a call); one that masks the history instead does not speed up at all.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dlinfer.ops as ops
import dlinfer.vendor

HQ, HKV, D, BS = 32, 8, 128, 64


def _time(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--windows", default="1024,4096")
    args = parser.parse_args(argv)
    dlinfer.vendor.use(args.vendor)
    dtype = getattr(torch, args.dtype)
    windows = [int(w) for w in args.windows.split(",")]
    print(f"vendor {args.vendor}, {args.dtype}, {torch.get_num_threads()} threads; Hq {HQ}, Hkv {HKV}, D {D}, "
          f"blocks of {BS}")
    print(f"{'context':>8} {'window':>7} {'ms median':>10} {'ms min':>8} {'speed-up':>9}")
    for ctx in (int(c) for c in args.contexts.split(",")):
        blocks = ctx // BS
        g = torch.Generator().manual_seed(0)
        kc = torch.randn(blocks + 1, BS, HKV, D, generator=g).to(dtype)
        vc = torch.randn(blocks + 1, BS, HKV, D, generator=g).to(dtype)
        table = torch.randperm(blocks + 1, generator=g)[:blocks].view(1, -1).int()
        q = torch.randn(1, HQ, D, generator=g).to(dtype)
        ends, kv = torch.tensor([1], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
        times = {w: [] for w in [None, *windows]}
        for _ in range(args.rounds):
            for w in times:
                times[w].append(_time(lambda w=w: ops.paged_decode_attention(q, kc, vc, table, BS, ends, kv, ctx, HQ,
                                                                              HKV, sliding_window=w)))
        base = statistics.median(times[None])
        for w, values in times.items():
            med = statistics.median(values)
            print(f"{ctx:>8} {w or '-':>7} {med * 1e3:>10.3f} {min(values) * 1e3:>8.3f} {base / med:>8.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
