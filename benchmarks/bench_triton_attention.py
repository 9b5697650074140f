"""Paged attention on a CUDA GPU: the triton vendor vs the torch vendor vs LMDeploy's own Triton kernels.

    python benchmarks/bench_triton_attention.py [--iters 30] [--dtype bfloat16]

Per config and implementation: median time of one call (CUDA events, L2 flushed before each
call), achieved GB/s = (bytes of K/V read + bytes of q read and out written) / time, and that as
a % of the GPU's peak HBM bandwidth (a table by GPU name; otherwise a measured large device
copy). Prefill also reports TFLOP/s (it is compute bound: GB/s there is only a lower bound).
LMDeploy is timed as its CUDA backend runs it: `flash_attn_with_kvcache` for decode,
`flatten_kv_cache` + `flash_attn_varlen_func` for prefill, caches [NB, BS, Hkv, D] ("bshd").
Every output is checked against the triton vendor's (max |diff| column).
No GPU: prints why and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

PEAK_TBPS = [  # (substrings all in the device name, peak HBM TB/s)
    (("H200",), 4.8),
    (("H100", "PCIe"), 2.0),
    (("H100", "NVL"), 3.9),
    (("H100",), 3.35),  # SXM (HBM3)
    (("A100", "80GB"), 2.0),
]

DECODE = [  # (name, batch, context, Hq, Hkv, D, block size)
    ("decode b64 x 4k", 64, 4096, 32, 8, 128, 64),
    ("decode b8 x 1k", 8, 1024, 32, 8, 128, 64),
]
PREFILL = [  # (name, batch, history, new tokens, Hq, Hkv, D, block size)
    ("prefill b4 x (3k hist + 1k new)", 4, 3072, 1024, 32, 8, 128, 64),
    ("prefill b1 x 2k new", 1, 0, 2048, 32, 8, 128, 64),
]


def peak_bandwidth(device) -> tuple:
    name = torch.cuda.get_device_name(device)
    for keys, tbps in PEAK_TBPS:
        if all(k in name for k in keys):
            return tbps * 1e12, f"{name}: peak {tbps} TB/s (table)"
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), iters=20, flush=None)
    bw = 2 * x.numel() / (ms * 1e-3)
    return bw, f"{name}: not in the table; measured 1 GiB device copy {bw / 1e12:.2f} TB/s used as peak"


def time_ms(fn, iters, flush) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()  # evict K/V from L2 so small configs are not served from cache
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paged_setup(batch, kv_lens, hkv, d, bs, dtype, device, g):
    """Token-major caches with shuffled blocks; block table int32 [B, M]."""
    need = [(n + bs - 1) // bs for n in kv_lens]
    nb = sum(need) + 1
    k_cache = torch.randn(nb, bs, hkv, d, generator=g, device=device).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g, device=device).to(dtype)
    perm = torch.randperm(nb, generator=g, device=device).to(torch.int32)
    table = torch.zeros(batch, max(need), dtype=torch.int32, device=device)
    pos = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[pos:pos + n]
        pos += n
    return k_cache, v_cache, table


def lmdeploy_kernels():
    try:
        from lmdeploy.pytorch.kernels.cuda import flash_attn_varlen_func, flash_attn_with_kvcache, flatten_kv_cache
        return flash_attn_with_kvcache, flatten_kv_cache, flash_attn_varlen_func, ""
    except Exception as exc:  # not installed, or its CUDA extras fail to import here
        return None, None, None, f"{type(exc).__name__}: {exc}"


def report(rows, title, peak):
    print(f"\n{title}")
    print(f"  {'impl':<10} {'median ms':>10} {'GB/s':>9} {'% peak':>7} {'TFLOP/s':>8} {'max|diff|':>10}")
    for impl, ms, nbytes, flops, diff in rows:
        if ms is None:
            print(f"  {impl:<10} skipped: {diff}")
            continue
        gbs = nbytes / (ms * 1e-3) / 1e9
        tfl = f"{flops / (ms * 1e-3) / 1e12:8.1f}" if flops else f"{'-':>8}"
        print(f"  {impl:<10} {ms:10.3f} {gbs:9.0f} {100 * gbs * 1e9 / peak:6.1f}% {tfl} {diff:10.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_triton_attention: no CUDA GPU available (torch.cuda.is_available() is False); "
              "nothing to measure.")
        return 0
    from dlinfer.vendor.torch import attention as torch_attn
    from dlinfer.vendor.triton import attention as triton_attn

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    elt = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(0)
    peak, peak_note = peak_bandwidth(device)
    lmd_decode, lmd_flatten, lmd_varlen, lmd_why = lmdeploy_kernels()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    print(f"{peak_note}; dtype {args.dtype}; median of {args.iters} calls, L2 flushed before each")

    for name, batch, ctx, hq, hkv, d, bs in DECODE:
        kv_lens = [ctx] * batch
        kc, vc, table = paged_setup(batch, kv_lens, hkv, d, bs, dtype, device, g)
        q = torch.randn(batch, hq, d, generator=g, device=device).to(dtype)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        kv = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        scale = d ** -0.5
        nbytes = sum(kv_lens) * hkv * 2 * d * elt + 2 * q.numel() * elt
        outs = {}

        def run_vendor(mod, key):
            out = torch.empty_like(q)
            outs[key] = out
            return lambda: mod.paged_decode_attention(q, kc, vc, table, cu, kv, ctx, scale, None, out, "token_major")

        calls = {"triton": run_vendor(triton_attn, "triton"), "torch": run_vendor(torch_attn, "torch")}
        if lmd_decode is not None:
            def lmd():
                outs["lmdeploy"] = lmd_decode(q, kc, vc, cache_seqlens=kv, page_table=table, cu_seqlens_q=cu,
                                              max_seqlen_q=1, softmax_scale=scale)
            calls["lmdeploy"] = lmd
        rows = []
        for impl, fn in calls.items():
            ms = time_ms(fn, args.iters, flush)
            rows.append([impl, ms, nbytes, 0, 0.0])
        for row in rows:
            row[4] = (outs[row[0]].float() - outs["triton"].float()).abs().max().item()
        if lmd_decode is None:
            rows.append(["lmdeploy", None, 0, 0, lmd_why])
        report(rows, f"{name}: Hq {hq}, Hkv {hkv}, D {d}, BS {bs}, "
                     f"{triton_attn.num_kv_splits(batch, hkv, ctx, torch.cuda.get_device_properties(device).multi_processor_count)}"
                     f" KV splits", peak)

    for name, batch, hist, new, hq, hkv, d, bs in PREFILL:
        kv_lens = [hist + new] * batch
        kc, vc, table = paged_setup(batch, kv_lens, hkv, d, bs, dtype, device, g)
        t = batch * new
        q = torch.randn(t, hq, d, generator=g, device=device).to(dtype)
        cu = torch.arange(0, t + 1, new, dtype=torch.int32, device=device)
        kv = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        scale = d ** -0.5
        nbytes = sum(kv_lens) * hkv * 2 * d * elt + 2 * q.numel() * elt
        keys_seen = batch * sum(hist + i + 1 for i in range(new))  # causal: query i sees hist + i + 1 keys
        flops = 4 * hq * d * keys_seen
        outs = {}

        def run_vendor(mod, key):
            out = torch.empty_like(q)
            outs[key] = out
            return lambda: mod.paged_prefill_attention(q, kc, vc, table, cu, kv, new, hist + new, scale, None, out,
                                                       "token_major")

        calls = {"triton": run_vendor(triton_attn, "triton"), "torch": run_vendor(torch_attn, "torch")}
        if lmd_flatten is not None:
            cu_k = torch.nn.functional.pad(kv.cumsum(0, dtype=torch.int32), (1, 0))
            total = sum(kv_lens)
            out_size = (total + bs - 1) // bs * bs + bs  # as LMDeploy's CUDA backend pads it

            def lmd():
                fk, fv = lmd_flatten(kc, vc, kv, table, start_loc=cu_k[:-1], out_size=out_size, out_dtype=dtype,
                                     flatten_kv_layout="hsd")
                outs["lmdeploy"] = lmd_varlen(q, fk, fv, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=new,
                                              max_seqlen_k=hist + new, softmax_scale=scale, causal=True,
                                              kv_layout="hsd")
            calls["lmdeploy"] = lmd
        rows = []
        for impl, fn in calls.items():
            ms = time_ms(fn, args.iters, flush)
            rows.append([impl, ms, nbytes, flops, 0.0])
        for row in rows:
            row[4] = (outs[row[0]].float() - outs["triton"].float()).abs().max().item()
        if lmd_flatten is None:
            rows.append(["lmdeploy", None, 0, 0, lmd_why])
        report(rows, f"{name}: Hq {hq}, Hkv {hkv}, D {d}, BS {bs} (lmdeploy = flatten + varlen flash attention)",
               peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
