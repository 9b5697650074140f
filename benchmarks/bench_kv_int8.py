"""paged_decode_attention on an int8 KV cache against the same call on a float cache, one process.

A Llama-3-8B attention layer (Hq 32, Hkv 8, D 128, block size 64) decoding B sequences of a long
context. Each round times, interleaved, the float32 and bfloat16 caches and the int8 cache (the
query float32 / bfloat16 as the model's), with the chosen vendor, through the public op (checks
included); it prints per-round medians, the median over rounds, the ratio float / int8, and the
bytes of K/V each call reads.

    .venv/bin/python benchmarks/bench_kv_int8.py [--vendor cpu] [--context 8192] [--batch 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_cpu_ops import median_time  # benchmarks/ is on sys.path when this file runs

import dlinfer.ops as ops
import dlinfer.vendor

HQ, HKV, D, BS = 32, 8, 128, 64




def make(batch, context, cache_dtype, q_dtype, g):
    blocks = batch * ((context + BS - 1) // BS)
    shape = (blocks, BS, HKV, D)
    if cache_dtype == torch.int8:
        kc = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        vc = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    else:
        kc = torch.randn(shape, generator=g).to(cache_dtype)
        vc = torch.randn(shape, generator=g).to(cache_dtype)
    table = torch.randperm(blocks, generator=g).view(batch, -1).to(torch.int32)
    q = torch.randn(batch, HQ, D, generator=g).to(q_dtype)
    q_ends = torch.arange(1, batch + 1, dtype=torch.int32)
    kv = torch.full((batch,), context, dtype=torch.int32)
    out = torch.empty_like(q)
    quant = {}
    if cache_dtype == torch.int8:
        quant = dict(kv_scales=torch.full((2, HKV), 0.02), kv_zeros=torch.zeros(2, HKV), quant_bits=8)

    def call():
        ops.paged_decode_attention(q, kc, vc, table, BS, q_ends, kv, context, HQ, HKV, head_size_v=D,
                                   attn_output=out, **quant)

    return call, (kc.numel() * kc.element_size() + vc.numel() * vc.element_size())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vendor", default="cpu")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    variants = {
        "float32 cache": (torch.float32, torch.float32),
        "int8 cache, float32 query": (torch.int8, torch.float32),
        "bfloat16 cache": (torch.bfloat16, torch.bfloat16),
        "int8 cache, bfloat16 query": (torch.int8, torch.bfloat16),
    }
    calls = {name: make(args.batch, args.context, c, q, g) for name, (c, q) in variants.items()}
    print(f"vendor {args.vendor}, batch {args.batch}, context {args.context}, Hq {HQ}, Hkv {HKV}, D {D}, "
          f"threads {torch.get_num_threads()}")
    times = {name: [] for name in calls}
    with torch.inference_mode(), dlinfer.vendor.using(args.vendor):
        for r in range(args.rounds):
            for name, (call, _) in calls.items():
                times[name].append(median_time(call, args.reps))
    for name, (call, nbytes) in calls.items():
        t = statistics.median(times[name])
        print(f"{name:28s} {t * 1e3:8.3f} ms  K/V {nbytes / 2**20:8.1f} MiB  {nbytes / t / 1e9:6.2f} GB/s  "
              f"rounds {' '.join(f'{x * 1e3:.2f}' for x in times[name])}")
    f32, i8f = statistics.median(times["float32 cache"]), statistics.median(times["int8 cache, float32 query"])
    b16, i8b = statistics.median(times["bfloat16 cache"]), statistics.median(times["int8 cache, bfloat16 query"])
    print(f"float32 / int8 time: {f32 / i8f:.2f}x   bfloat16 / int8 time: {b16 / i8b:.2f}x")


if __name__ == "__main__":
    main()
