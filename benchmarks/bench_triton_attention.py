"""Paged attention on a CUDA GPU: the triton vendor vs the torch vendor vs LMDeploy's own Triton kernels.

    python benchmarks/bench_triton_attention.py [--iters 30] [--dtype bfloat16] [--json FILE]

Per config and implementation: median kernel time of one call (CUDA events, L2 flushed before
each call, the host's launch work hidden: gpu_timing.py), the host time of issuing it, achieved
GB/s = (bytes of K/V read + bytes of q read and out written) / time, and that as a % of the GPU's
peak HBM bandwidth (a table by GPU name; otherwise a measured large device copy). Prefill also
reports TFLOP/s (it is compute bound: GB/s there is only a lower bound).
LMDeploy is timed as its CUDA backend runs it: `flash_attn_with_kvcache` for decode,
`flatten_kv_cache` + `flash_attn_varlen_func` for prefill, caches [NB, BS, Hkv, D] ("bshd").
Every output is checked against the triton vendor's (max |diff| column).
No GPU: prints why and exits 0. `--dry-run` runs the same code on the CPU under TRITON_INTERPRET=1
at tiny sizes with one call (scripts/gpu_check.sh --dry-run): it checks the script, times nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import device_time, host_time, peaks, require_interpreter, write_json  # noqa: E402

DECODE = [  # (name, batch, context, Hq, Hkv, D, block size)
    ("decode b64 x 4k", 64, 4096, 32, 8, 128, 64),
    ("decode b8 x 1k", 8, 1024, 32, 8, 128, 64),
]
PREFILL = [  # (name, batch, history, new tokens, Hq, Hkv, D, block size)
    ("prefill b4 x (3k hist + 1k new)", 4, 3072, 1024, 32, 8, 128, 64),
    ("prefill b1 x 2k new", 1, 0, 2048, 32, 8, 128, 64),
]
DRY_DECODE = [("decode b3 x 40 (dry run)", 3, 40, 4, 2, 16, 16)]
DRY_PREFILL = [("prefill b2 x (20 hist + 12 new) (dry run)", 2, 20, 12, 4, 2, 16, 16)]


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


def report(rows, title, peak, results):
    """Print one config's rows and keep them (as dicts) in `results`."""
    print(f"\n{title}")
    print(f"  {'impl':<10} {'median ms':>10} {'host ms':>8} {'GB/s':>9} {'% peak':>7} {'TFLOP/s':>8} {'max|diff|':>10}")
    for impl, ms, nbytes, flops, diff, host_ms in rows:
        if ms is None:
            print(f"  {impl:<10} skipped: {diff}")
            results.append({"config": title, "impl": impl, "error": str(diff)})
            continue
        gbs = nbytes / (ms * 1e-3) / 1e9
        pct = 100 * gbs * 1e9 / peak if peak else None
        tf = flops / (ms * 1e-3) / 1e12 if flops else None
        print(f"  {impl:<10} {ms:10.3f} {host_ms:8.3f} {gbs:9.0f} {f'{pct:6.1f}%' if pct else '      -':>7} "
              f"{f'{tf:8.1f}' if tf else '       -':>8} {diff:10.2e}")
        results.append({"config": title, "impl": impl, "ms": ms, "host_ms": host_ms, "gb_per_s": gbs,
                        "bw_share_pct": pct, "tflops": tf, "max_abs_diff_vs_triton": diff})


def timed(fn, iters, device):
    """Median milliseconds of fn(), or (None, error text) when it raises."""
    try:
        return device_time(fn, iters, device) * 1e3, None
    except Exception as exc:  # e.g. LMDeploy's kernel on a GPU it does not support: a finding
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, TRITON_INTERPRET=1, tiny sizes, one call: checks the script, times nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        require_interpreter()
        device, iters, decode_cfgs, prefill_cfgs = torch.device("cpu"), 1, DRY_DECODE, DRY_PREFILL
    elif not torch.cuda.is_available():
        print("bench_triton_attention: no CUDA GPU available (torch.cuda.is_available() is False); "
              "nothing to measure.")
        return 0
    else:
        device, iters, decode_cfgs, prefill_cfgs = torch.device("cuda"), args.iters, DECODE, PREFILL
    from dlinfer.vendor.torch import attention as torch_attn
    from dlinfer.vendor.triton import attention as triton_attn
    from dlinfer.vendor.triton._common import num_sms

    dtype = getattr(torch, args.dtype)
    elt = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(0)
    pk = peaks(str(device))
    peak = pk["bytes_per_s"]
    lmd_decode, lmd_flatten, lmd_varlen, lmd_why = lmdeploy_kernels()
    results = []
    print(f"{pk['name']}: peak {f'{peak / 1e12:.2f} TB/s' if peak else '-'} ({pk['source']}); dtype {args.dtype}; "
          f"median of {iters} calls" + (", L2 flushed before each" if device.type == "cuda" else "; DRY RUN"))
    sms = num_sms(device)

    for name, batch, ctx, hq, hkv, d, bs in decode_cfgs:
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
        rows = time_rows(calls, outs, iters, device, nbytes, 0)
        if lmd_decode is None:
            rows.append(["lmdeploy", None, 0, 0, lmd_why])
        report(rows, f"{name}: Hq {hq}, Hkv {hkv}, D {d}, BS {bs}, "
                     f"{triton_attn.num_kv_splits(batch, hkv, ctx, sms)} KV splits", peak, results)

    for name, batch, hist, new, hq, hkv, d, bs in prefill_cfgs:
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
        rows = time_rows(calls, outs, iters, device, nbytes, flops)
        if lmd_flatten is None:
            rows.append(["lmdeploy", None, 0, 0, lmd_why])
        report(rows, f"{name}: Hq {hq}, Hkv {hkv}, D {d}, BS {bs} (lmdeploy = flatten + varlen flash attention)",
               peak, results)
    write_json(args.json, {"bench": "attention", "device": pk, "dtype": args.dtype, "iters": iters,
                           "dry_run": args.dry_run, "torch": torch.__version__, "lmdeploy_unavailable": lmd_why,
                           "rows": results})
    return 1 if any("error" in r and r["impl"] != "lmdeploy" for r in results) else 0


def time_rows(calls, outs, iters, device, nbytes, flops):
    """[impl, ms, bytes, flops, max |diff| vs triton, host ms] per implementation; a failed one carries
    its error."""
    rows = []
    for impl, fn in calls.items():
        ms, err = timed(fn, iters, device)
        host = host_time(fn, iters, device) * 1e3 if ms is not None else None
        rows.append([impl, ms, nbytes, flops, err if ms is None else 0.0, host])
    for row in rows:
        if row[1] is not None and "triton" in outs and row[0] in outs:
            row[4] = (outs[row[0]].float() - outs["triton"].float()).abs().max().item()
    return rows


if __name__ == "__main__":
    sys.exit(main())
