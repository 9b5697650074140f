"""Triton-vendor kernels on one CUDA GPU, against the torch vendor and LMDeploy's own CUDA Triton kernels.

For each op and size it prints the median kernel time (CUDA events, L2 flushed before every rep,
the host's launch work hidden; see gpu_timing.py), and for triton and LMDeploy the host time of
issuing one call, of
  triton   dlinfer's triton vendor function (canonical arguments, no ops-layer checks),
  torch    dlinfer's torch vendor function (same arguments),
  lmdeploy lmdeploy.pytorch.kernels.cuda (rms_norm, apply_rotary_pos_emb, fill_kv_cache,
           silu_and_mul, fused_moe, per_token_quant_int8, matmul_kernel_dynamic_quant,
           awq_linear) when LMDeploy imports, else "-",
the achieved GB/s (or TFLOP/s for GEMM-bound cases) of the triton kernel and its share of the GPU's
peak, and the largest difference from the torch vendor (relative to the largest |output|), so a
first run on a new GPU also checks the kernels. A row that raises is printed with its error and
the run goes on.

Sizes: a 7B-class dense layer (H 4096, Hq 32, Hkv 8, D 128, I 11008, block size 64) at decode
(T = 64 sequences x 1 token) and prefill (T = 4096); a Mixtral-like MoE (E 8, K 2, H 4096,
I 14336 scaled to a tensor-parallel shard, --moe-inter, default 14336/4); the quantised linears at
N = 11008, K = 4096 (W8A8: int8 x int8 per-token x per-channel; W4A16: AWQ layout, group 128).

    python benchmarks/bench_triton_ops.py [--dtype bf16|fp16|fp32] [--reps 50] [--moe-inter 3584] [--json F]

`--dry-run` runs every row on the CPU under TRITON_INTERPRET=1 at tiny sizes with one rep: it
proves the script and each kernel call work (scripts/gpu_check.sh --dry-run); its times are no
timings.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import device_time, host_time, peaks, require_interpreter, share, write_json  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Sizes:
    h: int
    hq: int
    hkv: int
    d: int
    inter: int
    bs: int
    dense_cases: tuple  # (tokens, label)
    moe_cases: tuple
    experts: int
    topk: int
    group: int
    decode_history: int


FULL = Sizes(4096, 32, 8, 128, 11008, 64, ((64, "decode T=64"), (4096, "prefill T=4096")),
             ((16, "decode T=16"), (2048, "prefill T=2048")), 8, 2, 128, 1023)
TINY = Sizes(64, 4, 2, 16, 96, 16, ((4, "decode T=4"), (32, "prefill T=32")),
             ((4, "decode T=4"), (16, "prefill T=16")), 4, 2, 32, 31)


def lmdeploy_kernels():
    """LMDeploy's CUDA Triton kernels, or (None, why)."""
    try:
        from lmdeploy.pytorch.kernels.cuda.activation import silu_and_mul
        from lmdeploy.pytorch.kernels.cuda.apply_rotary_pos_emb import apply_rotary_pos_emb
        from lmdeploy.pytorch.kernels.cuda.awq_kernels import awq_linear
        from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache
        from lmdeploy.pytorch.kernels.cuda.moe.fused_moe import fused_moe
        from lmdeploy.pytorch.kernels.cuda.rms_norm import rms_norm
        from lmdeploy.pytorch.kernels.cuda.w8a8_triton_kernels import matmul_kernel_dynamic_quant, per_token_quant_int8
    except Exception as exc:  # any import failure: run without that column
        return None, f"{type(exc).__name__}: {exc}"
    return dict(rms_norm=rms_norm, rotary=apply_rotary_pos_emb, fill_kv_cache=fill_kv_cache,
                silu_and_mul=silu_and_mul, fused_moe=fused_moe, per_token_quant_int8=per_token_quant_int8,
                w8a8=matmul_kernel_dynamic_quant, awq_linear=awq_linear), None


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


class Bench:
    """Times rows and keeps them (printed as they come, returned as dicts for --json)."""

    def __init__(self, device, reps, peak, dry_run):
        self.device, self.reps, self.peak, self.dry_run = device, reps, peak, dry_run
        self.rows = []

    def row(self, op, case, make):
        """make() -> dict(tri=fn, tor=fn, lm=fn|None, nbytes=int, flops=int|None, err=float|str,
        lm_err=fn|None (LMDeploy's result against the torch vendor's), int8=bool (FLOPs against the
        int8 peak, twice the bf16 one)): built and timed inside one try, so a failing op is a row
        with its error, not the end of the run."""
        out = {"op": op, "case": case}
        try:
            spec = make()
            t_tri = device_time(spec["tri"], self.reps, self.device)
            out["triton_host_us"] = host_time(spec["tri"], self.reps, self.device) * 1e6
            t_tor = device_time(spec["tor"], self.reps, self.device)
            lm_fn, t_lm = spec.get("lm"), None
            if lm_fn is not None:
                try:
                    t_lm = device_time(lm_fn, self.reps, self.device)
                    out["lmdeploy_host_us"] = host_time(lm_fn, self.reps, self.device) * 1e6
                    if spec.get("lm_err"):
                        e = spec["lm_err"]()
                        out["lmdeploy_err"] = e if isinstance(e, str) else f"{e:.1e}"
                except Exception as exc:  # LMDeploy's kernel failing is a finding, not the end
                    out["lmdeploy_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            gbs = spec["nbytes"] / t_tri
            flops = spec.get("flops")
            err = spec["err"]
            out.update(triton_us=t_tri * 1e6, torch_us=t_tor * 1e6, lmdeploy_us=t_lm * 1e6 if t_lm else None,
                       vs_torch=t_tor / t_tri, vs_lmdeploy=t_lm / t_tri if t_lm else None, gb_per_s=gbs / 1e9,
                       bw_share=share(gbs, self.peak["bytes_per_s"]),
                       tflops=flops / t_tri / 1e12 if flops else None,
                       flops_share=share(flops / t_tri, self.peak["flops"] and self.peak["flops"] * (
                           2 if spec.get("int8") else 1)) if flops else "-",
                       err=err if isinstance(err, str) else f"{err:.1e}")
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        self.rows.append(out)
        print(format_row(out), flush=True)


HEADER = (f"{'op':<24}{'case':<26}{'triton us':>10}{'torch us':>10}{'lmdeploy us':>12}{'vs torch':>9}"
          f"{'vs lmd':>8}  {'triton throughput':<30}{'err vs torch':>14}")


def format_row(r) -> str:
    if "error" in r:
        return f"{r['op']:<24}{r['case']:<26}ERROR {r['error']}"
    lm = f"{r['lmdeploy_us']:12.1f}" if r["lmdeploy_us"] else f"{'-':>12}"
    vs_lm = f"{r['vs_lmdeploy']:7.2f}x" if r["vs_lmdeploy"] else f"{'-':>8}"
    thr = f"{r['gb_per_s']:7.0f} GB/s {r['bw_share']:>4}"
    if r["tflops"]:
        thr += f" {r['tflops']:6.1f} TF/s {r['flops_share']:>4}"
    line = (f"{r['op']:<24}{r['case']:<26}{r['triton_us']:10.1f}{r['torch_us']:10.1f}{lm}{r['vs_torch']:8.2f}x"
            f"{vs_lm}  {thr:<30}{r['err']:>14}")
    line += f"  lmdeploy err {r['lmdeploy_err']}" if "lmdeploy_err" in r else ""
    line += f"  host us: triton {r['triton_host_us']:.1f}" if "triton_host_us" in r else ""
    line += f" lmdeploy {r['lmdeploy_host_us']:.1f}" if "lmdeploy_host_us" in r else ""
    return line + (f"  (lmdeploy: {r['lmdeploy_error']})" if "lmdeploy_error" in r else "")


def dense_rows(b: Bench, tri, tor, lm, sz: Sizes, dtype):
    dev, es = b.device, dtype.itemsize
    h, hq, hkv, d, inter = sz.h, sz.hq, sz.hkv, sz.d, sz.inter
    for tokens, case in sz.dense_cases:
        x = torch.randn(tokens, h, dtype=dtype, device=dev)
        r = torch.randn_like(x)
        w = torch.randn(h, dtype=dtype, device=dev)
        b.row("rms_norm", case, lambda: dict(
            tri=lambda: tri["rms_norm"](x, w, 1e-6), tor=lambda: tor["rms_norm"](x, w, 1e-6),
            lm=(lambda: lm["rms_norm"](x, w, 1e-6)) if lm else None, nbytes=2 * tokens * h * es + h * es,
            err=rel_err(tri["rms_norm"](x, w, 1e-6), tor["rms_norm"](x, w, 1e-6)),
            lm_err=lambda: rel_err(lm["rms_norm"](x, w, 1e-6), tor["rms_norm"](x, w, 1e-6))))
        b.row("add_rms_norm", case, lambda: dict(
            tri=lambda: tri["add_rms_norm"](x, r, w, 1e-6), tor=lambda: tor["add_rms_norm"](x, r, w, 1e-6),
            lm=(lambda: lm["rms_norm"](x, w, 1e-6, residual=r)) if lm else None,
            nbytes=4 * tokens * h * es + h * es,
            err=rel_err(tri["add_rms_norm"](x, r, w, 1e-6)[0], tor["add_rms_norm"](x, r, w, 1e-6)[0]),
            lm_err=lambda: rel_err(lm["rms_norm"](x, w, 1e-6, residual=r)[0],
                                   tor["add_rms_norm"](x, r, w, 1e-6)[0])))

        q = torch.randn(tokens, hq, d, dtype=dtype, device=dev)
        k = torch.randn(tokens, hkv, d, dtype=dtype, device=dev)
        ang = torch.rand(tokens, d // 2, device=dev) * 100
        cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)

        def rotary():
            qt, kt = tri["apply_rotary_pos_emb"](q, k, cos, sin)
            qr, kr = tor["apply_rotary_pos_emb"](q, k, cos, sin)
            return dict(tri=lambda: tri["apply_rotary_pos_emb"](q, k, cos, sin),
                        tor=lambda: tor["apply_rotary_pos_emb"](q, k, cos, sin),
                        lm=(lambda: lm["rotary"](q, k, cos, sin)) if lm else None,
                        nbytes=2 * tokens * (hq + hkv) * d * es + 2 * tokens * d * es,
                        err=max(rel_err(qt, qr), rel_err(kt, kr)),
                        lm_err=lambda: max(rel_err(o, ref) for o, ref in zip(lm["rotary"](q, k, cos, sin), (qr, kr))))
        b.row("apply_rotary_pos_emb", case, rotary)

        gu = torch.randn(tokens, 2 * inter, dtype=dtype, device=dev)
        b.row("silu_and_mul", f"{case} I={inter}", lambda: dict(
            tri=lambda: tri["silu_and_mul"](gu), tor=lambda: tor["silu_and_mul"](gu),
            lm=(lambda: lm["silu_and_mul"](gu)) if lm else None, nbytes=3 * tokens * inter * es,
            err=rel_err(tri["silu_and_mul"](gu), tor["silu_and_mul"](gu)),
            lm_err=lambda: rel_err(lm["silu_and_mul"](gu), tor["silu_and_mul"](gu))))

        b.row("fill_kv_cache", case, lambda: fill_spec(tri, tor, lm, sz, tokens, case, dtype, dev))

        wl = torch.randn(inter, h, dtype=dtype, device=dev) * h**-0.5
        b.row("linear (F.linear)", f"{case} N={inter}", lambda: dict(
            tri=lambda: tri["linear"](x, wl, None), tor=lambda: tor["linear"](x, wl, None), lm=None,
            nbytes=(tokens * h + inter * h + tokens * inter) * es, flops=2 * tokens * h * inter, err="same fn"))
        quant_rows(b, tri, tor, lm, sz, tokens, case, x)


def fill_spec(tri, tor, lm, sz: Sizes, tokens, case, dtype, dev):
    """The paged cache: decode = T sequences at position decode_history; prefill = 4 sequences of
    T/4 new tokens. Exact equality with the torch vendor (and LMDeploy's kernel) is the check."""
    bs, hkv, d, es = sz.bs, sz.hkv, sz.d, dtype.itemsize
    n_seq, q_len, hist = (tokens, 1, sz.decode_history) if case.startswith("decode") else (4, tokens // 4, 0)
    kv_len = hist + q_len
    m = (kv_len + bs - 1) // bs
    nb = n_seq * m + 16
    table = torch.randperm(nb, device=dev)[: n_seq * m].view(n_seq, m).int()
    pos = torch.arange(hist, kv_len, device=dev)
    slots = (table[:, pos // bs] * bs + pos % bs).reshape(-1)  # [n_seq * q_len] int32
    kc_t = torch.zeros(nb, bs, hkv, d, dtype=dtype, device=dev)
    vc_t, kc_l, vc_l = torch.zeros_like(kc_t), torch.zeros_like(kc_t), torch.zeros_like(kc_t)
    kv_k = torch.randn(tokens, hkv, d, dtype=dtype, device=dev)
    kv_v = torch.randn(tokens, hkv, d, dtype=dtype, device=dev)
    tri["fill_kv_cache"](kv_k, kv_v, kc_t, vc_t, slots, "token_major")
    exact, lm_fill = "exact", None
    if lm:
        q_start = torch.arange(0, tokens, q_len, dtype=torch.int32, device=dev)
        q_lens = torch.full((n_seq,), q_len, dtype=torch.int32, device=dev)
        kv_lens = torch.full((n_seq,), kv_len, dtype=torch.int32, device=dev)

        def lm_fill():
            lm["fill_kv_cache"](kv_k, kv_v, kc_l, vc_l, q_start, q_lens, kv_lens, q_len, table)

        try:
            lm_fill()
            exact = "exact" if torch.equal(kc_t, kc_l) and torch.equal(vc_t, vc_l) else "MISMATCH(lmd)"
        except Exception as exc:
            exact, lm_fill = f"lmd failed: {type(exc).__name__}", None
    kc_r, vc_r = torch.zeros_like(kc_t), torch.zeros_like(kc_t)
    tor["fill_kv_cache"](kv_k, kv_v, kc_r, vc_r, slots, "token_major")
    if not (torch.equal(kc_t, kc_r) and torch.equal(vc_t, vc_r)):
        exact = "MISMATCH"
    return dict(tri=lambda: tri["fill_kv_cache"](kv_k, kv_v, kc_t, vc_t, slots, "token_major"),
                tor=lambda: tor["fill_kv_cache"](kv_k, kv_v, kc_r, vc_r, slots, "token_major"), lm=lm_fill,
                nbytes=4 * tokens * hkv * d * es + 4 * tokens, err=exact)


def quant_rows(b: Bench, tri, tor, lm, sz: Sizes, tokens, case, x):
    """W8A8 (dynamic per-token activation quantisation, then the int8 GEMM) and W4A16 (AWQ layout)
    at N = I, K = H; the same tensors go to all three implementations."""
    dev, dtype = b.device, x.dtype
    n, k, g = sz.inter, sz.h, sz.group
    b.row("dynamic_quant", case, lambda: dict(
        tri=lambda: tri["dynamic_quant"](x), tor=lambda: tor["dynamic_quant"](x),
        lm=(lambda: lm["per_token_quant_int8"](x, 1e-7)) if lm else None,
        nbytes=tokens * k * (dtype.itemsize + 1) + 4 * tokens,
        err=f"codes {'exact' if torch.equal(tri['dynamic_quant'](x)[0], tor['dynamic_quant'](x)[0]) else 'DIFFER'}"))
    xq = torch.randint(-127, 128, (tokens, k), dtype=torch.int8, device=dev)
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
    rs = torch.rand(tokens, device=dev) * 1e-2 + 1e-3
    ls = torch.rand(n, device=dev) * 1e-2 + 1e-3
    b.row("linear_w8a8", f"{case} N={n}", lambda: dict(
        tri=lambda: tri["linear_w8a8"](xq, wq, rs, ls, dtype), tor=lambda: tor["linear_w8a8"](xq, wq, rs, ls, dtype),
        lm=(lambda: lm["w8a8"](xq, wq, rs, ls, output_dtype=dtype)) if lm else None,
        nbytes=tokens * k + n * k + tokens * n * dtype.itemsize, flops=2 * tokens * n * k, int8=True,
        err=rel_err(tri["linear_w8a8"](xq, wq, rs, ls, dtype), tor["linear_w8a8"](xq, wq, rs, ls, dtype)),
        lm_err=lambda: rel_err(lm["w8a8"](xq, wq, rs, ls, output_dtype=dtype), tor["linear_w8a8"](xq, wq, rs, ls,
                                                                                                  dtype))))
    bits = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    zeros = torch.randint(-2**31, 2**31 - 1, (k // g, n // 8), dtype=torch.int32, device=dev)
    scales = (torch.rand(k // g, n, device=dev) * 2e-3 + 1e-4).half()
    w4 = (lambda: tri["weight_quant_matmul"](x, bits, scales, zeros, None, g),  # noqa: E731
          lambda: tor["weight_quant_matmul"](x, bits, scales, zeros, None, g))  # noqa: E731
    # LMDeploy's AWQ kernel dequantises to float16 and takes float16 activations: its own caller
    # (backends/cuda/awq_modules.py) casts x to half and the result back, and so does this row
    lm_w4 = (lambda: lm["awq_linear"](x.half(), bits, scales, zeros).to(dtype)) if lm else None  # noqa: E731
    b.row("weight_quant_matmul W4", f"{case} N={n} g={g}", lambda: dict(
        tri=w4[0], tor=w4[1], lm=lm_w4, lm_err=lambda: rel_err(lm_w4(), w4[1]()),
        nbytes=tokens * k * dtype.itemsize + k * n // 2 + (k // g) * n * 2.5 + tokens * n * dtype.itemsize,
        flops=2 * tokens * n * k, err=rel_err(w4[0](), w4[1]())))


def moe_rows(b: Bench, tri, tor, lm, sz: Sizes, inter, dtype):
    dev, es, h, e, k = b.device, dtype.itemsize, sz.h, sz.experts, sz.topk
    gate_up = torch.randn(e, 2 * inter, h, dtype=dtype, device=dev) * h**-0.5
    down = torch.randn(e, h, inter, dtype=dtype, device=dev) * inter**-0.5
    for tokens, case in sz.moe_cases:
        logits = torch.randn(tokens, e, dtype=dtype, device=dev)

        def gating():
            wt, it = tri["moe_gating_topk_softmax"](logits, k)
            wr, ir = tor["moe_gating_topk_softmax"](logits, k)
            return dict(tri=lambda: tri["moe_gating_topk_softmax"](logits, k),
                        tor=lambda: tor["moe_gating_topk_softmax"](logits, k), lm=None,
                        nbytes=tokens * e * es + tokens * k * 12,
                        err=f"{rel_err(wt, wr):.1e}" + ("" if torch.equal(it, ir) else " IDS DIFFER"))
        b.row("moe_gating_topk_softmax", f"{case} E={e} K={k}", gating)
        wr, ir = tor["moe_gating_topk_softmax"](logits, k)
        x = torch.randn(tokens, h, dtype=dtype, device=dev)
        active = int(torch.unique(ir).numel())
        moe_tri = lambda: tri["fused_moe"](x, gate_up, down, wr, ir, True)  # noqa: E731
        moe_tor = lambda: tor["fused_moe"](x, gate_up, down, wr, ir, True)  # noqa: E731
        b.row("fused_moe", f"{case} I={inter}", lambda: dict(
            tri=moe_tri, tor=moe_tor,
            lm=(lambda: lm["fused_moe"](x, gate_up, down, wr, ir, k, renormalize=True)) if lm else None,
            nbytes=active * 3 * inter * h * es + 2 * tokens * h * es, flops=6 * tokens * k * h * inter,
            err=rel_err(moe_tri(), moe_tor()),
            lm_err=lambda: rel_err(lm["fused_moe"](x, gate_up, down, wr, ir, k, renormalize=True), moe_tor())))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--moe-inter", type=int, default=14336 // 4)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, TRITON_INTERPRET=1, tiny sizes, one rep: checks the script, times nothing")
    args = parser.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.dry_run:
        require_interpreter()
        device, sz, reps, inter = "cpu", TINY, 1, 32
    else:
        if not torch.cuda.is_available() or interpreted:
            sys.exit("bench_triton_ops.py needs a CUDA GPU and TRITON_INTERPRET unset: the interpreter (the "
                     "triton vendor's CPU path) is for tests, not timings (see --dry-run). Nothing was measured.")
        device, sz, reps, inter = "cuda", FULL, args.reps, args.moe_inter

    import dlinfer.vendor as V

    tri, tor = V.load("triton").ops, V.load("torch").ops
    lm, lm_why = lmdeploy_kernels()
    dtype = DTYPES[args.dtype]
    peak = peaks(device)
    bw = f"{peak['bytes_per_s'] / 1e12:.2f} TB/s" if peak["bytes_per_s"] else "-"
    print(f"device: {peak['name']}; peak {bw} ({peak['source']})"
          + (f", {peak['flops'] / 1e12:.0f} dense TFLOP/s" if peak["flops"] else "; FLOP peak unknown")
          + f"; torch {torch.__version__}; dtype {dtype}; median of {reps} reps"
          + (", L2 flushed" if device == "cuda" else "; DRY RUN: interpreter times, not timings"))
    if lm is None:
        print(f"LMDeploy kernels unavailable ({lm_why}): that column shows '-'")
    print(HEADER)
    torch.manual_seed(0)
    bench = Bench(device, reps, peak, args.dry_run)
    dense_rows(bench, tri, tor, lm, sz, dtype)
    moe_rows(bench, tri, tor, lm, sz, inter, dtype)
    print("GB/s counts each op's compulsory traffic (inputs read once, outputs written once; fused_moe: the "
          "weights of the experts in use); decode-sized cases are launch/latency bound.")
    write_json(args.json, {"bench": "ops", "device": peak, "dtype": str(dtype), "reps": reps,
                           "dry_run": args.dry_run, "torch": torch.__version__, "lmdeploy_unavailable": lm_why,
                           "rows": bench.rows})
    return 1 if any("error" in r for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
