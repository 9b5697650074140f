"""Tile configurations of the triton vendor's slowest kernels against LMDeploy's, swept on a GPU:
for each kernel and shape, the launcher's own choice and a few alternatives, each checked against
the launcher's own output and timed (gpu_timing.device_time: CUDA events, L2 flushed).

    python benchmarks/gpu_tile_sweep.py [--reps 10] [--json FILE]
    TRITON_INTERPRET=1 python benchmarks/gpu_tile_sweep.py --dry-run     # CPU, tiny, proves the script

The H200 runs (docs/gpu.md) left W4A16 and paged prefill attention at prefill short of LMDeploy,
and paged decode attention at 0.97x (batch 64 x 4k) and 0.84x (batch 8 x 1k): those are swept, the
decode by its split rule's constants, keys per tile, warps and stages. Also timed, so that a later
change shows: fused_moe at prefill, the quantisers' two exact quotient forms (their codes required
equal) and prefill attention's walk of the fully visible key tiles without a mask (bit for bit).
Each launcher takes its tiles from one function (`_group_tiles`, `_tiles`, `_linear_tiles`, W4A16's
K split `_group_splits`, the quantisers' `quotient_form`, prefill attention's `mask_split`); the
sweep replaces that function for a call, so what is timed is the real launcher with another tile. A
configuration the GPU cannot launch (shared memory) is reported as such; an alternative that must
not change a bit and does, as a MISMATCH. The table says, per case, the launcher's time, the best
alternative and the speedup: what to change next, measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from gpu_timing import device_time, require_interpreter  # noqa: E402


@contextmanager
def tiles(module, name: str, value):
    """module.<name> returns `value` (whatever its arguments) within the block; None: untouched."""
    if value is None:
        yield
        return
    saved = getattr(module, name)
    setattr(module, name, lambda *a, **k: value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def w4_cases(dev, dtype, dry):
    from dlinfer.vendor.triton import weight_quant as W

    g = torch.Generator(device=dev).manual_seed(0)
    k, n, group = (256, 256, 64) if dry else (4096, 11008, 128)
    q = torch.randint(-2**31, 2**31 - 1, (k, n // 8), generator=g, device=dev, dtype=torch.int32)
    s = (torch.rand(k // group, n, generator=g, device=dev) / 50).to(dtype)
    z = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), generator=g, device=dev, dtype=torch.int32)
    # (BLOCK_M, BLOCK_N, largest BLOCK_K, num_warps, num_stages)
    alts = {1: [(16, 64, 128, 4, 3), (16, 32, 128, 4, 3), (16, 128, 64, 4, 3), (16, 64, 64, 4, 4)],
            64: [(64, 64, 64, 4, 3), (64, 32, 64, 4, 3), (32, 64, 128, 4, 3), (64, 64, 32, 4, 4)],
            4096: [(128, 64, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3), (128, 64, 32, 4, 4)]}
    for m in ([1, 64] if dry else [1, 64, 4096]):
        x = torch.randn(m, k, generator=g, device=dev).to(dtype)
        bytes_ = q.numel() * 4 + s.numel() * s.element_size() + x.numel() * x.element_size()
        yield (f"weight_quant_matmul W4 M={m} K={k} N={n} g={group}", W, "_group_tiles",
               lambda x=x: W.weight_quant_matmul(x, q, s, z, None, group), alts[m][:2 if dry else None],
               bytes_, 2 * m * k * n)
    # the K split of few rows (_group_splits): its rule's choice against fixed counts
    for m in ([1] if dry else [1, 16]):
        x = torch.randn(m, k, generator=g, device=dev).to(dtype)
        bytes_ = q.numel() * 4 + s.numel() * s.element_size() + x.numel() * x.element_size()
        yield (f"weight_quant_matmul W4 K splits M={m} K={k} N={n} g={group}", W, "_group_splits",
               lambda x=x: W.weight_quant_matmul(x, q, s, z, None, group), [2] if dry else [1, 2, 8, 16],
               bytes_, 2 * m * k * n)


def w8a8_cases(dev, dtype, dry):
    from dlinfer.vendor.triton import quant as Q

    g = torch.Generator(device=dev).manual_seed(0)
    k, n = (256, 192) if dry else (4096, 11008)
    b = torch.randint(-127, 128, (n, k), generator=g, device=dev, dtype=torch.int8)
    ls = torch.rand(n, generator=g, device=dev) / 100
    alts = [(128, 128, 128, 8), (128, 256, 64, 8), (128, 128, 64, 4), (64, 128, 128, 4), (256, 128, 64, 8)]
    for m in ([80] if dry else [4096]):
        a = torch.randint(-127, 128, (m, k), generator=g, device=dev, dtype=torch.int8)
        rs = torch.rand(m, generator=g, device=dev) / 100
        yield (f"linear_w8a8 M={m} K={k} N={n}", Q, "_linear_tiles",
               lambda a=a, rs=rs: Q.linear_w8a8(a, b, rs, ls, dtype), alts[:2] if dry else alts,
               a.numel() + b.numel() + m * n * 2, 2 * m * k * n)


def quant_cases(dev, dtype, dry):
    """dynamic_quant and add_rms_norm_w8a8 with the quotient's other form (quant.quotient_form):
    their codes must equal the launcher's exactly (the case's last field)."""
    from dlinfer.vendor.triton import quant as Q

    g = torch.Generator(device=dev).manual_seed(0)
    t, h = (8, 256) if dry else (4096, 4096)
    x = torch.randn(t, h, generator=g, device=dev).to(dtype)
    r = torch.randn(t, h, generator=g, device=dev).to(dtype)
    w = torch.rand(h, generator=g, device=dev).to(dtype) + 0.5

    forms = [0]  # form 1 is the launcher's own; the calls' outputs (codes, scales) are compared whole
    yield (f"dynamic_quant T={t} H={h}", Q, "quotient_form", lambda: Q.dynamic_quant(x), forms,
           t * h * (x.element_size() + 1) + 4 * t, None, True)
    yield (f"add_rms_norm_w8a8 T={t} H={h}", Q, "quotient_form",
           lambda: Q.add_rms_norm_w8a8(x, r, w, 1e-6), forms, t * h * (3 * x.element_size() + 1) + 4 * t,
           None, True)


def decode_cases(dev, dtype, dry):
    """Paged decode attention: the split rule's programs per SM, keys per tile, warps and stages
    (attention_decode._tiles). Bytes: the keys and values read, the query and output."""
    from bench_triton_attention import paged_setup

    from dlinfer.vendor.triton import attention_decode as A

    g = torch.Generator(device=dev).manual_seed(0)
    hq, hkv, d, bs = (4, 2, 64, 16) if dry else (32, 8, 128, 64)
    shapes = [("b2 x 300", 2, 300)] if dry else [("b64 x 4k", 64, 4096), ("b8 x 1k", 8, 1024)]
    # (programs per SM, fewest keys a segment, keys per tile, num_warps, num_stages); own: (4, 128, 0, 4, 0)
    alts = [(4, 256, 0, 4, 0), (2, 128, 0, 4, 0), (8, 128, 0, 4, 0), (16, 64, 0, 4, 0), (4, 128, 0, 4, 2),
            (4, 128, 0, 8, 0), (4, 128, 128, 4, 0)]
    for label, batch, ctx in shapes:
        kc, vc, table = paged_setup(batch, [ctx] * batch, hkv, d, bs, dtype, dev, g)
        q = torch.randn(batch, hq, d, generator=g, device=dev).to(dtype)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        kv = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

        def call(q=q, kc=kc, vc=vc, table=table, cu=cu, kv=kv, ctx=ctx):
            out = torch.empty_like(q)
            A.paged_decode(q, kc, vc, table, cu, kv, ctx, d ** -0.5, None, out, "token_major")
            return out

        nbytes = 2 * batch * ctx * hkv * d * kc.element_size() + 2 * q.numel() * q.element_size()
        yield (f"paged_decode_attention {label} Hq {hq} Hkv {hkv} D {d}", A, "_tiles", call,
               alts[:2] if dry else alts, nbytes, 4 * batch * ctx * hq * d)


def prefill_cases(dev, dtype, dry):
    from bench_triton_attention import paged_setup

    from dlinfer.vendor.triton import attention_prefill as P

    g = torch.Generator(device=dev).manual_seed(0)
    hq, hkv, d, bs = (4, 2, 64, 16) if dry else (32, 8, 128, 64)
    shapes = [("b1 x 40 new", [(0, 40)])] if dry else [("b4 x (3k history + 1k new)", [(3072, 1024)] * 4),
                                                       ("b1 x 2k new", [(0, 2048)])]
    # (BLOCK_M, BLOCK_N, num_stages, num_warps)
    alts = [(128, 64, 2, 8), (128, 128, 3, 8), (128, 128, 2, 4), (64, 64, 3, 4), (64, 128, 2, 4)]
    for label, seqs in shapes:
        kv_lens = [h + n for h, n in seqs]
        kc, vc, table = paged_setup(len(seqs), kv_lens, hkv, d, bs, dtype, dev, g)
        t = sum(n for _, n in seqs)
        q = torch.randn(t, hq, d, generator=g, device=dev).to(dtype)
        cu = torch.tensor([0] + list(torch.tensor([n for _, n in seqs]).cumsum(0)), dtype=torch.int32, device=dev)
        kv = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        max_q, max_kv = max(n for _, n in seqs), max(kv_lens)

        def call(q=q, kc=kc, vc=vc, table=table, cu=cu, kv=kv, max_q=max_q, max_kv=max_kv):
            out = torch.empty_like(q)
            P.paged_prefill(q, kc, vc, table, cu, kv, max_q, max_kv, d ** -0.5, None, out, "token_major")
            return out

        flops = sum(4 * n * (h + (n + 1) / 2) * hq * d for h, n in seqs)
        yield (f"paged_prefill_attention {label} Hq {hq} Hkv {hkv} D {d}", P, "_tiles", call,
               alts[:2] if dry else alts, None, flops)
        # the key tiles every row sees, walked without a mask: the same bits (the last field)
        yield (f"paged_prefill_attention {label} Hq {hq} Hkv {hkv} D {d}, unmasked tiles", P, "mask_split", call,
               [True], None, flops, True)


def moe_cases(dev, dtype, dry):
    from dlinfer.vendor.triton import moe as M

    g = torch.Generator(device=dev).manual_seed(0)
    e, topk, h, inter = (4, 2, 64, 96) if dry else (8, 2, 4096, 3584)
    t = 40 if dry else 2048
    x = torch.randn(t, h, generator=g, device=dev).to(dtype) / 4
    gu = (torch.randn(e, 2 * inter, h, generator=g, device=dev) / h ** 0.5).to(dtype)
    dn = (torch.randn(e, h, inter, generator=g, device=dev) / inter ** 0.5).to(dtype)
    w = torch.rand(t, topk, generator=g, device=dev)
    ids = torch.stack([torch.randperm(e, generator=g, device=dev)[:topk] for _ in range(t)]).to(torch.int64)
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    alts = [(64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 32, 4, 4)]
    yield (f"fused_moe T={t} E={e} top{topk} H={h} I={inter}", M, "_tiles",
           lambda: M.fused_moe(x, gu, dn, w, ids, False), alts[:2] if dry else alts, None,
           2 * t * topk * 3 * h * inter)


def flat(out) -> torch.Tensor:
    """A call's output (a tensor or a tuple of them) as one float vector, for the comparison only:
    the timed call returns what the op returns, with no copy of its own."""
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([p.float().flatten() for p in parts])


def max_abs_diff(got: torch.Tensor, base: torch.Tensor) -> float:
    """The largest |got - base|; NaN in both at one place counts as equal, NaN in one as inf (a
    NaN difference would pass neither the tolerance nor the MISMATCH test)."""
    if not got.numel():
        return 0.0
    diff = torch.nan_to_num((got - base).abs(), nan=float("inf"))
    return float(torch.where(got.isnan() & base.isnan(), 0.0, diff).max())


def sweep(case, reps, dev) -> dict:
    name, module, fn_name, call, alts, nbytes, flops, *rest = case
    exact = bool(rest and rest[0])  # the optional last field: alternatives must match bit for bit
    base = flat(call())
    row = {"case": name, "function": f"{module.__name__.rsplit('.', 1)[-1]}.{fn_name}", "configs": []}
    for cfg in [None] + list(alts):
        entry = {"tiles": "launcher's own" if cfg is None else list(cfg) if isinstance(cfg, (tuple, list)) else cfg}
        try:
            with tiles(module, fn_name, cfg):
                t0 = time.perf_counter()
                got = flat(call())
                took = time.perf_counter() - t0
                entry["max_abs_diff"] = max_abs_diff(got, base)
                # the dry run (CPU) times the call it checked: one interpreted call per alternative
                entry["us"] = (device_time(call, reps, str(dev)) if dev.type == "cuda" else took) * 1e6
        except Exception as exc:  # e.g. out of shared memory on this GPU: a finding, not a failure
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        row["configs"].append(entry)
    own = row["configs"][0].get("us")
    limit = 0.0 if exact else 0.05 * max(1.0, float(base.abs().max()))
    ok = [c for c in row["configs"][1:] if "us" in c and c["max_abs_diff"] <= limit]
    # an alternative that must not change a bit and did: a finding, not merely "not faster"
    row["mismatch"] = [c["tiles"] for c in row["configs"][1:] if exact and "us" in c and c["max_abs_diff"] > limit]
    best = min(ok, key=lambda c: c["us"], default=None)
    row["own_us"], row["best"] = own, best
    row["speedup"] = own / best["us"] if best and own else None
    if own and flops:
        row["own_tflops"] = flops / own / 1e6
    if own and nbytes:
        row["own_gb_s"] = nbytes / own / 1e3
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, one call each")
    args = ap.parse_args(argv)
    if args.dry_run:
        require_interpreter()
        dev, reps = torch.device("cpu"), 1
    elif not torch.cuda.is_available():
        print("gpu_tile_sweep: no CUDA GPU available; nothing to measure.")
        return 0
    else:
        dev, reps = torch.device("cuda"), args.reps
    dtype = torch.bfloat16
    rows = []
    for make in (w4_cases, w8a8_cases, quant_cases, decode_cases, prefill_cases, moe_cases):
        for case in make(dev, dtype, args.dry_run):
            try:
                row = sweep(case, reps, dev)
            except Exception as exc:  # the launcher's own config failed: report, go on
                row = {"case": case[0], "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            rows.append(row)
            if args.json:  # after every case: a step cut off at its budget keeps what was done
                write_json(args.json, args.dry_run, dtype, reps, rows)
            if "error" in row:
                print(f"{row['case']}: ERROR {row['error']}", flush=True)
                continue
            best = row["best"]
            head = f"{row['case']}: own {row['own_us']:.1f} us"
            head += f"; best {best['tiles']} {best['us']:.1f} us ({row['speedup']:.2f}x)" if best else "; none better"
            if row["mismatch"]:
                head += f"; MISMATCH (must be exact): {row['mismatch']}"
            lines = [f"    {c['tiles']}: " + (f"{c['us']:.1f} us, diff {c['max_abs_diff']:.2e}" if "us" in c
                                               else c["error"]) for c in row["configs"]]
            print("\n".join([head, *lines]), flush=True)
    if args.json:
        write_json(args.json, args.dry_run, dtype, reps, rows)
    return 0


def write_json(path, dry, dtype, reps, rows) -> None:
    Path(path).write_text(json.dumps({"dry_run": dry, "dtype": str(dtype), "reps": reps, "torch": torch.__version__,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
