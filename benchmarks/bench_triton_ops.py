"""Triton-vendor kernels on one CUDA GPU, against the torch vendor and LMDeploy's own CUDA Triton kernels.

For each op and size it prints the median time (CUDA events, L2 flushed before every rep) of
  triton   dlinfer's triton vendor function (canonical arguments, no ops-layer checks),
  torch    dlinfer's torch vendor function (same arguments),
  lmdeploy lmdeploy.pytorch.kernels.cuda (rms_norm, apply_rotary_pos_emb, fill_kv_cache,
           silu_and_mul, fused_moe) when LMDeploy imports, else "-",
the achieved GB/s (or TFLOP/s for GEMM-bound cases) of the triton kernel and its share of the GPU's
peak, and the largest difference from the torch vendor (relative to the largest |output|), so a
first run on a new GPU also checks the kernels.

Peaks by GPU name: H100 SXM (HBM3) 3.35 TB/s and ~990 dense bf16 TFLOP/s, H200 4.8 TB/s and ~990;
any other GPU: the copy bandwidth measured here, and no FLOP peak.

Sizes: a 7B-class dense layer (H 4096, Hq 32, Hkv 8, D 128, I 11008, block size 64) at decode
(T = 64 sequences x 1 token) and prefill (T = 4096); a Mixtral-like MoE (E 8, K 2, H 4096,
I 14336 scaled to a tensor-parallel shard, --moe-inter, default 14336/4).

    .venv/bin/python benchmarks/bench_triton_ops.py [--dtype bf16|fp16|fp32] [--reps 50] [--moe-inter 3584]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

H, HQ, HKV, D, INTER, BS = 4096, 32, 8, 128, 11008, 64
E, K = 8, 2
DENSE_CASES = ((64, "decode T=64"), (4096, "prefill T=4096"))  # decode: T sequences x 1 token at 1023
MOE_CASES = ((16, "decode T=16"), (2048, "prefill T=2048"))
DEVICE = "cuda"
PEAKS = (("H200", 4.8e12, 989e12), ("H100 SXM", 3.35e12, 989e12), ("H100 80GB HBM3", 3.35e12, 989e12))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_flush = None


def cuda_time(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, each timed by CUDA events after an L2 flush."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3


def copy_bandwidth() -> float:
    """Bytes moved per second (read + write) by a 1 GiB device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src), 20)


def peaks():
    name = torch.cuda.get_device_name()
    for key, bw, flops in PEAKS:
        if key in name:
            return name, bw, flops, "table"
    return name, copy_bandwidth(), None, "measured copy bandwidth"


def lmdeploy_kernels():
    """LMDeploy's CUDA Triton kernels, or (None, why)."""
    try:
        from lmdeploy.pytorch.kernels.cuda.activation import silu_and_mul
        from lmdeploy.pytorch.kernels.cuda.apply_rotary_pos_emb import apply_rotary_pos_emb
        from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache
        from lmdeploy.pytorch.kernels.cuda.moe.fused_moe import fused_moe
        from lmdeploy.pytorch.kernels.cuda.rms_norm import rms_norm
    except Exception as exc:  # any import failure: run without that column
        return None, f"{type(exc).__name__}: {exc}"
    return dict(rms_norm=rms_norm, rotary=apply_rotary_pos_emb, fill_kv_cache=fill_kv_cache,
                silu_and_mul=silu_and_mul, fused_moe=fused_moe), None


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--moe-inter", type=int, default=14336 // 4)
    args = parser.parse_args()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_triton_ops.py needs a CUDA GPU and TRITON_INTERPRET unset: the interpreter (the "
                 "triton vendor's CPU path) is for tests, not timings. Nothing was measured.")

    import dlinfer.vendor as V

    tri, tor = V.get("triton").ops, V.get("torch").ops
    lm, lm_why = lmdeploy_kernels()
    dtype, reps, es = DTYPES[args.dtype], args.reps, DTYPES[args.dtype].itemsize
    gpu, peak_bw, peak_flops, source = peaks()
    print(f"GPU: {gpu}; peak {peak_bw / 1e12:.2f} TB/s ({source})"
          + (f", {peak_flops / 1e12:.0f} dense TFLOP/s" if peak_flops else "; FLOP peak unknown")
          + f"; torch {torch.__version__}; dtype {dtype}; median of {reps} reps, L2 flushed")
    if lm is None:
        print(f"LMDeploy kernels unavailable ({lm_why}): that column shows '-'")
    print(f"{'op':<24}{'case':<22}{'triton us':>10}{'torch us':>10}{'lmdeploy us':>12}"
          f"{'vs torch':>9}{'vs lmd':>8}  {'triton throughput':<30}{'err vs torch':>12}")

    def row(op, case, fn_tri, fn_tor, fn_lm, nbytes, flops=None, err=None):
        t_tri, t_tor = cuda_time(fn_tri, reps), cuda_time(fn_tor, reps)
        t_lm = cuda_time(fn_lm, reps) if fn_lm is not None else None
        gbs = nbytes / t_tri
        thr = f"{gbs / 1e9:7.0f} GB/s {100 * gbs / peak_bw:3.0f}%"
        if flops:
            tf = flops / t_tri
            thr += f" {tf / 1e12:6.1f} TF/s" + (f" {100 * tf / peak_flops:3.0f}%" if peak_flops else "")
        lm_s = f"{t_lm * 1e6:12.1f}" if t_lm else f"{'-':>12}"
        vs_lm = f"{t_lm / t_tri:7.2f}x" if t_lm else f"{'-':>8}"
        err_s = err if isinstance(err, str) else f"{err:.1e}"
        print(f"{op:<24}{case:<22}{t_tri * 1e6:10.1f}{t_tor * 1e6:10.1f}{lm_s}{t_tor / t_tri:8.2f}x{vs_lm}  "
              f"{thr:<30}{err_s:>12}", flush=True)

    torch.manual_seed(0)
    dev = DEVICE
    for tokens, case in DENSE_CASES:
        x = torch.randn(tokens, H, dtype=dtype, device=dev)
        r = torch.randn_like(x)
        w = torch.randn(H, dtype=dtype, device=dev)
        row("rms_norm", case, lambda: tri["rms_norm"](x, w, 1e-6), lambda: tor["rms_norm"](x, w, 1e-6),
            (lambda: lm["rms_norm"](x, w, 1e-6)) if lm else None, 2 * tokens * H * es + H * es,
            err=rel_err(tri["rms_norm"](x, w, 1e-6), tor["rms_norm"](x, w, 1e-6)))
        row("add_rms_norm", case, lambda: tri["add_rms_norm"](x, r, w, 1e-6),
            lambda: tor["add_rms_norm"](x, r, w, 1e-6),
            (lambda: lm["rms_norm"](x, w, 1e-6, residual=r)) if lm else None, 4 * tokens * H * es + H * es,
            err=rel_err(tri["add_rms_norm"](x, r, w, 1e-6)[0], tor["add_rms_norm"](x, r, w, 1e-6)[0]))

        q = torch.randn(tokens, HQ, D, dtype=dtype, device=dev)
        k = torch.randn(tokens, HKV, D, dtype=dtype, device=dev)
        ang = torch.rand(tokens, D // 2, device=dev) * 100
        cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
        qt, kt = tri["apply_rotary_pos_emb"](q, k, cos, sin)
        qr, kr = tor["apply_rotary_pos_emb"](q, k, cos, sin)
        row("apply_rotary_pos_emb", case, lambda: tri["apply_rotary_pos_emb"](q, k, cos, sin),
            lambda: tor["apply_rotary_pos_emb"](q, k, cos, sin),
            (lambda: lm["rotary"](q, k, cos, sin)) if lm else None,
            2 * tokens * (HQ + HKV) * D * es + 2 * tokens * D * es, err=max(rel_err(qt, qr), rel_err(kt, kr)))

        gu = torch.randn(tokens, 2 * INTER, dtype=dtype, device=dev)
        row("silu_and_mul", case + " I=11008", lambda: tri["silu_and_mul"](gu), lambda: tor["silu_and_mul"](gu),
            (lambda: lm["silu_and_mul"](gu)) if lm else None, 3 * tokens * INTER * es,
            err=rel_err(tri["silu_and_mul"](gu), tor["silu_and_mul"](gu)))

        # paged cache: decode = T sequences at position 1023; prefill = 4 sequences of T/4 new tokens
        n_seq, q_len, hist = (tokens, 1, 1023) if case.startswith("decode") else (4, tokens // 4, 0)
        kv_len = hist + q_len
        m = (kv_len + BS - 1) // BS
        nb = n_seq * m + 16
        table = torch.randperm(nb, device=dev)[: n_seq * m].view(n_seq, m).int()
        pos = torch.arange(hist, kv_len, device=dev)
        slots = (table[:, pos // BS] * BS + pos % BS).reshape(-1)  # [n_seq * q_len] int32
        kc_t = torch.zeros(nb, BS, HKV, D, dtype=dtype, device=dev)
        vc_t, kc_l, vc_l = torch.zeros_like(kc_t), torch.zeros_like(kc_t), torch.zeros_like(kc_t)
        kv_k = torch.randn(tokens, HKV, D, dtype=dtype, device=dev)
        kv_v = torch.randn(tokens, HKV, D, dtype=dtype, device=dev)
        tri["fill_kv_cache"](kv_k, kv_v, kc_t, vc_t, slots, "token_major")
        exact = "exact"
        lm_fill = None
        if lm:
            q_start = torch.arange(0, tokens, q_len, dtype=torch.int32, device=dev)
            q_lens = torch.full((n_seq,), q_len, dtype=torch.int32, device=dev)
            kv_lens = torch.full((n_seq,), kv_len, dtype=torch.int32, device=dev)

            def lm_fill():
                lm["fill_kv_cache"](kv_k, kv_v, kc_l, vc_l, q_start, q_lens, kv_lens, q_len, table)

            lm_fill()
            exact = "exact" if torch.equal(kc_t, kc_l) and torch.equal(vc_t, vc_l) else "MISMATCH(lmd)"
        kc_r, vc_r = torch.zeros_like(kc_t), torch.zeros_like(kc_t)
        tor["fill_kv_cache"](kv_k, kv_v, kc_r, vc_r, slots, "token_major")
        if not (torch.equal(kc_t, kc_r) and torch.equal(vc_t, vc_r)):
            exact = "MISMATCH"
        row("fill_kv_cache", case, lambda: tri["fill_kv_cache"](kv_k, kv_v, kc_t, vc_t, slots, "token_major"),
            lambda: tor["fill_kv_cache"](kv_k, kv_v, kc_r, vc_r, slots, "token_major"), lm_fill,
            4 * tokens * HKV * D * es + 4 * tokens, err=exact)

        wl = torch.randn(INTER, H, dtype=dtype, device=dev) * H**-0.5
        row("linear (F.linear)", case + " N=11008", lambda: tri["linear"](x, wl, None),
            lambda: tor["linear"](x, wl, None), None, (tokens * H + INTER * H + tokens * INTER) * es,
            flops=2 * tokens * H * INTER, err="same fn")

    inter = args.moe_inter
    gate_up = torch.randn(E, 2 * inter, H, dtype=dtype, device=dev) * H**-0.5
    down = torch.randn(E, H, inter, dtype=dtype, device=dev) * inter**-0.5
    for tokens, case in MOE_CASES:
        logits = torch.randn(tokens, E, dtype=dtype, device=dev)
        wt, it = tri["moe_gating_topk_softmax"](logits, K)
        wr, ir = tor["moe_gating_topk_softmax"](logits, K)
        ids_ok = "" if torch.equal(it, ir) else " IDS DIFFER"
        row("moe_gating_topk_softmax", case + " E=8 K=2", lambda: tri["moe_gating_topk_softmax"](logits, K),
            lambda: tor["moe_gating_topk_softmax"](logits, K), None, tokens * E * es + tokens * K * 12,
            err=f"{rel_err(wt, wr):.1e}{ids_ok}")
        x = torch.randn(tokens, H, dtype=dtype, device=dev)
        active = int(torch.unique(ir).numel())
        nbytes = active * 3 * inter * H * es + 2 * tokens * H * es
        moe_tri = lambda: tri["fused_moe"](x, gate_up, down, wr, ir, True)  # noqa: E731
        moe_tor = lambda: tor["fused_moe"](x, gate_up, down, wr, ir, True)  # noqa: E731
        row("fused_moe", f"{case} I={inter}", moe_tri, moe_tor,
            (lambda: lm["fused_moe"](x, gate_up, down, wr, ir, K, renormalize=True)) if lm else None,
            nbytes, flops=6 * tokens * K * H * inter, err=rel_err(moe_tri(), moe_tor()))
    print("GB/s counts each op's compulsory traffic (inputs read once, outputs written once; fused_moe: the "
          "weights of the experts in use); decode-sized cases are launch/latency bound.")


if __name__ == "__main__":
    main()
