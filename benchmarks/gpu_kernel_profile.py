"""The triton vendor's kernels furthest from their bound on the H200 (docs/gpu.md), each run once
inside a CUDA profiler range, for Nsight Compute:

    ncu --profile-from-start off --section SpeedOfLight ... python benchmarks/gpu_kernel_profile.py
    TRITON_INTERPRET=1 python benchmarks/gpu_kernel_profile.py --dry-run     # CPU, tiny: proves the script

Cases: W4A16 (AWQ, group 128) at M = 1 and M = 4096, K = 4096, N = 11008; paged prefill attention
b1 x 2k new tokens (Hq 32, Hkv 8, D 128, block 64); dynamic_quant at T = 4096, H = 4096. Each is
called three times before the range (compilation, warm caches) and once inside it, so ncu sees one
launch per kernel of each case. scripts/gpu_profile.sh runs it under ncu on the GPU machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from bench_triton_attention import paged_setup  # noqa: E402
from gpu_timing import require_interpreter  # noqa: E402


def cases(dev, dry):
    from dlinfer.vendor.triton import attention as A
    from dlinfer.vendor.triton import quant as Q
    from dlinfer.vendor.triton import weight_quant as W

    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16
    k, n, group = (256, 256, 64) if dry else (4096, 11008, 128)
    q = torch.randint(-2**31, 2**31 - 1, (k, n // 8), generator=g, device=dev, dtype=torch.int32)
    s = (torch.rand(k // group, n, generator=g, device=dev) / 50).to(dtype)
    z = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), generator=g, device=dev, dtype=torch.int32)
    for m in ([1, 32] if dry else [1, 4096]):
        x = torch.randn(m, k, generator=g, device=dev).to(dtype)
        yield f"weight_quant_matmul M={m}", lambda x=x: W.weight_quant_matmul(x, q, s, z, None, group)
    batch, hist, new, hq, hkv, d, bs = (1, 0, 40, 4, 2, 64, 16) if dry else (1, 0, 2048, 32, 8, 128, 64)
    kv_lens = [hist + new] * batch
    kc, vc, table = paged_setup(batch, kv_lens, hkv, d, bs, dtype, dev, g)
    qa = torch.randn(batch * new, hq, d, generator=g, device=dev).to(dtype)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=dev)
    kv = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
    out = torch.empty_like(qa)
    yield (f"paged_prefill_attention b{batch} x {new}",
           lambda: A.paged_prefill_attention(qa, kc, vc, table, cu, kv, new, hist + new, d ** -0.5, None, out,
                                             "token_major"))
    xq = torch.randn(64 if dry else 4096, 256 if dry else 4096, generator=g, device=dev).to(dtype)
    yield f"dynamic_quant T={xq.shape[0]}", lambda: Q.dynamic_quant(xq)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    args = ap.parse_args(argv)
    if args.dry_run:
        require_interpreter()
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_kernel_profile: no CUDA GPU available; nothing to profile.")
        return 0
    else:
        dev = torch.device("cuda")
    todo = list(cases(dev, args.dry_run))
    for name, fn in todo:  # compile and warm every case before the range
        for _ in range(1 if args.dry_run else 3):
            fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for name, fn in todo:
        print(f"[gpu_kernel_profile] {name}", flush=True)
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    if dev.type == "cuda":
        torch.cuda.cudart().cudaProfilerStop()
    print(f"[gpu_kernel_profile] {len(todo)} cases ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
