"""The fixed cost of one op call on the cpu vendor: the op function (its per-call checks and choices)
against the call-site binding a compiled graph uses (Vendor.graph_bindings, docs/graph.md "Call sites
bound once"), each at tiny shapes where the kernel itself takes a microsecond or two, so that what
differs is the Python around it.

    .venv/bin/python benchmarks/bench_call_overhead.py [--dtype bfloat16] [--rounds 7] [--calls 2000]

The two sides alternate call by call in one process (same tensors, same kernel); each side's time a
call is the minimum over rounds of the mean over `--calls` calls. The last column multiplies the
saving by the calls a SmolLM2-135M decode step makes (30 layers: 4 linears, 2 norms, one rotary,
cache fill, attention and silu-and-mul each, plus the final norm).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlinfer.vendor import TOKEN_MAJOR, registry  # noqa: E402

CALLS_A_SMOLLM2_STEP = {"linear": 120, "add_rms_norm": 60, "rms_norm": 1, "apply_rotary_pos_emb": 30,
                        "fill_kv_cache": 30, "paged_decode_attention": 30, "silu_and_mul": 30}


def cases(dtype: torch.dtype) -> dict:
    """op -> its canonical arguments at decode shapes small enough that the kernel is ~1 us."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    cache = (r(8, 4, 1, 16), r(8, 4, 1, 16))
    table, cu = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    kv_len = torch.tensor([5], dtype=torch.int32)
    return {
        "linear": (r(1, 32), r(16, 32), None),
        "add_rms_norm": (r(1, 32), r(1, 32), r(32), 1e-6),
        "rms_norm": (r(1, 32), r(32), 1e-6),
        "apply_rotary_pos_emb": (r(1, 2, 16), r(1, 1, 16), r(1, 16), r(1, 16)),
        "fill_kv_cache": (r(1, 1, 16), r(1, 1, 16), *cache, torch.tensor([4]), TOKEN_MAJOR),
        "paged_decode_attention": (r(1, 2, 16), *cache, table, cu, kv_len, 5, 0.25, None, r(1, 2, 16), TOKEN_MAJOR),
        "silu_and_mul": (r(1, 32),),
    }


def per_call_us(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    vendor = registry.load("cpu")
    print(f"| op ({args.dtype}) | op function: us a call | bound: us a call | saved a call | saved a SmolLM2 step |")
    print("|---|---|---|---|---|")
    total = 0.0
    with torch.inference_mode():
        for op, call_args in cases(dtype).items():
            fn, bound = vendor.ops[op], vendor.graph_bindings[op](*call_args)
            if bound is None:
                print(f"| {op} | | not bound at these arguments | | |")
                continue
            best = {"fn": float("inf"), "bound": float("inf")}
            per_call_us(fn, call_args, 100)
            per_call_us(bound, call_args, 100)
            for _ in range(args.rounds):
                best["fn"] = min(best["fn"], per_call_us(fn, call_args, args.calls))
                best["bound"] = min(best["bound"], per_call_us(bound, call_args, args.calls))
            saved = best["fn"] - best["bound"]
            step = saved * CALLS_A_SMOLLM2_STEP[op]
            total += step
            print(f"| {op} | {best['fn']:.2f} | {best['bound']:.2f} | {saved:.2f} | {step:.0f} us |")
    print(f"\nA SmolLM2-135M decode step's calls: {total:.0f} us less Python ({args.dtype}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
