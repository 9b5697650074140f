"""dlinfer's CPU vendors (torch, cpu) against naive PyTorch, op by op, on this machine's CPU.

Prints, per op and size, the median time of a naive implementation of the same math (the
baseline: per-sequence loops for attention, per-token loops for fill_kv_cache and fused_moe,
unfused eager torch for the elementwise ops, `x @ w.t()` for linear) and of dlinfer's public op
on each CPU vendor (checks included), with the ratio baseline / vendor (> 1: dlinfer faster).
Memory-bound ops also print the bytes they must read per second against this machine's read
bandwidth, measured in the same run.

Sizes: a 7B-class layer (Llama-3-8B: H 4096, Hq 32, Hkv 8, D 128, I 14336) with batch and
context scaled for a 2-core CPU, plus the decode-time `linear` of SmolLM2-135M (H 576, 30 layers),
whose weights stream from memory at every call like a real decode step's, and its W8A8 form
(`linear_w8a8`, int8 weights, at K = 576 and N = 1536 / 576 / 49152, against float32 `linear`).

    .venv/bin/python benchmarks/bench_cpu_ops.py [--quick] [--vendors torch,cpu] [--w4-only] [--bf16-only]
        [--threads N]
    .venv/bin/python benchmarks/bench_cpu_ops.py --prefill-only   # prefill attention, SmolLM2 heads

The W4A16 table (`weight_quant_matmul`, cpu vendor, SmolLM2-135M shapes at 1 and 8 rows): GB/s of
packed weight streamed against the read bandwidth, and the float32 `linear` of the same shape.
The bfloat16 table (`linear_16bit_cases`, cpu vendor, same shapes): the few-row bf16 kernel on each
of its paths against oneDNN's bf16 `F.linear` and the float32 kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dlinfer.ops as ops
import dlinfer.vendor

H, HQ, HKV, D, INTER = 4096, 32, 8, 128, 14336
BS = 64


def timeit(fn, min_time=0.3, min_reps=3):
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_time(fn, reps=5, warmup=1):
    """Median seconds of `reps` calls of fn after `warmup` warm-up calls (a fixed count, unlike timeit)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(nbytes=512 << 20):
    """Bytes per second a sum over a large float32 tensor reads (the machine's read bandwidth)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / timeit(lambda: src.sum(), min_time=0.5)


def copy_bandwidth(nbytes=256 << 20):
    """Source bytes per second of a large tensor copy (reads and writes: about half the above)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return nbytes / timeit(lambda: dst.copy_(src), min_time=0.5)


# ---------------------------------------------------------------- naive implementations
def naive_rms_norm(x, w, eps):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * w


def naive_rotary(q, k, cos, sin):
    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), -1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rot(q) * s, k * c + rot(k) * s


def naive_fill(k, v, kc, vc, slots):
    for t, slot in enumerate(slots.tolist()):
        kc[slot // BS, slot % BS] = k[t]
        vc[slot // BS, slot % BS] = v[t]


def naive_attention_one(q, k, v, scale):
    """q [n, Hq, D], k/v [L, Hkv, D] (last n keys are q's own) -> [n, Hq, D]; fp32 math."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1).float().transpose(0, 1)
    v = v.repeat_interleave(g, 1).float().transpose(0, 1)
    s = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale
    n, L = q.shape[0], k.shape[1]
    allowed = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).to(q.dtype)


def naive_paged(q, kc, vc, table, cu, kv_lens, scale):
    out = torch.empty_like(q)
    for b in range(len(kv_lens)):
        s, e, L = int(cu[b]), int(cu[b + 1]), int(kv_lens[b])
        blocks = table[b, : (L + BS - 1) // BS]
        k = kc[blocks].reshape(-1, HKV, D)[:L]
        v = vc[blocks].reshape(-1, HKV, D)[:L]
        out[s:e] = naive_attention_one(q[s:e], k, v, scale)
    return out


def naive_moe(x, gate_up, down, w, ids):
    out = torch.zeros_like(x, dtype=torch.float32)
    inter = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = gate_up[e] @ x[t]
            out[t] += w[t, j] * (down[e] @ (F.silu(gu[:inter]) * gu[inter:])).float()
    return out.to(x.dtype)


def paged_setup(batch, ctx, new, dtype):
    """Decode / prefill inputs over a paged cache in random block order."""
    num_blocks_seq = (ctx + BS - 1) // BS
    nb = batch * num_blocks_seq + 3
    kc = torch.randn(nb, BS, HKV, D, dtype=dtype)
    vc = torch.randn(nb, BS, HKV, D, dtype=dtype)
    table = torch.randperm(nb)[: batch * num_blocks_seq].view(batch, num_blocks_seq).int()
    q = torch.randn(batch * new, HQ, D, dtype=dtype)
    kv_lens = torch.full((batch,), ctx, dtype=torch.int32)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32)
    return q, kc, vc, table, cu, kv_lens


def prefill_cases(vendors, repeats=3):
    """Prefill attention at SmolLM2-135M's heads (Hq 9, Hkv 3, D 64), one sequence of T tokens:
    `prefill_attention` (no history) and `paged_prefill_attention` (T new tokens after T of
    history, LMDeploy's second chunk), float32 and bfloat16. Vendors and the naive loop alternate
    `repeats` times (paired); each cell is the best of its rounds' medians."""
    hq, hkv, d, bs = 9, 3, 64, 64
    scale = d ** -0.5
    print(f"prefill attention, SmolLM2-135M heads (Hq {hq}, Hkv {hkv}, D {d}), one sequence, block size {bs}; "
          f"{torch.get_num_threads()} threads; vendors and naive alternated {repeats}x, best of the medians")
    print("| op | dtype | T | naive ms | " + " | ".join(f"{v} ms" for v in vendors) +
          (" | torch / cpu |" if {"torch", "cpu"} <= set(vendors) else " |"))
    print("|---" * (4 + len(vendors) + ({"torch", "cpu"} <= set(vendors))) + "|", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        for t in (32, 512, 1024, 2048):
            g = torch.Generator().manual_seed(t)
            q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
            lens = torch.tensor([t], dtype=torch.int32)
            nb = 2 * t // bs + 2
            kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
            table = torch.randperm(nb, generator=g)[: (2 * t + bs - 1) // bs].view(1, -1).int()
            kv_lens = torch.tensor([2 * t], dtype=torch.int32)

            def naive_paged_one():
                blocks = table[0]
                kk = kc[blocks].reshape(-1, hkv, d)[: 2 * t]
                vv = vc[blocks].reshape(-1, hkv, d)[: 2 * t]
                return naive_attention_one(q, kk, vv, scale)

            cases = {
                "prefill_attention": (lambda: naive_attention_one(q, k, v, scale),
                                      lambda: ops.prefill_attention(q, k, v, None, None, lens, lens, t, hq, hkv, [])),
                "paged_prefill_attention (history T)": (
                    naive_paged_one,
                    lambda: ops.paged_prefill_attention(q, None, None, kc, vc, table, bs, lens, kv_lens, t, 2 * t,
                                                        hq, hkv, [])),
            }
            for name, (naive, call) in cases.items():
                best = {}
                for _ in range(repeats):
                    best["naive"] = min(best.get("naive", 1e9), timeit(naive, min_time=0.1))
                    for ven in vendors:
                        with dlinfer.vendor.using(ven):
                            best[ven] = min(best.get(ven, 1e9), timeit(call, min_time=0.1))
                cells = [f"{best[x] * 1e3:.2f}" for x in ("naive", *vendors)]
                if {"torch", "cpu"} <= set(vendors):
                    cells.append(f"{best['torch'] / best['cpu']:.1f}x")
                print(f"| {name} | {str(dtype)[6:]} | {t} | " + " | ".join(cells) + " |", flush=True)


# ---------------------------------------------------------------- the run
class Table:
    def __init__(self, vendors, bandwidth, copy_bw):
        self.vendors, self.bw, self.copy_bw = vendors, bandwidth, copy_bw
        head = " | ".join(f"{v} ms | ratio" for v in vendors)
        print(f"| op | size | naive ms | {head} | bytes read by the fastest vendor |")
        print("|---" * (4 + 2 * len(vendors)) + "|", flush=True)

    def case(self, name, size, naive, call, nbytes=None):
        """naive(): the baseline; call(): the public op (run under each vendor); nbytes: what a
        memory-bound op must read per call."""
        base = timeit(naive)
        cells, best = [], None
        for v in self.vendors:
            with dlinfer.vendor.using(v):
                t = timeit(call)
            best = t if best is None else min(best, t)
            cells += [f"{t * 1e3:.3f}", f"{base / t:.2f}x"]
        note = (f"{nbytes / best / 1e9:.1f} GB/s = {nbytes / best / self.bw:.2f} of read bw, "
                f"{nbytes / best / self.copy_bw:.2f} of copy bw" if nbytes else "")
        print(f"| {name} | {size} | {base * 1e3:.3f} | " + " | ".join(cells) + f" | {note} |", flush=True)


def linear_cases(tab, dtype):
    """linear at decode: SmolLM2-135M's four projections of all 30 layers, cycled, so that every
    call streams its weights from memory (425 MB, freed when this returns)."""
    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))
    layers = [[torch.randn(n, k, dtype=dtype) for n, k in shapes] for _ in range(30)]
    nbytes = sum(w.numel() * w.element_size() for layer in layers for w in layer)
    for rows in (1, 8):
        xs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
        tab.case("linear", f"T={rows}, 120 SmolLM2 weights",
                 lambda: [xs[w.shape[1]] @ w.t() for layer in layers for w in layer],
                 lambda: [ops.linear(xs[w.shape[1]], w) for layer in layers for w in layer], nbytes)


def linear_16bit_cases(bw, rounds=3):
    """bfloat16 `linear` at decode on the cpu vendor, SmolLM2-135M's shapes (K 576: N 960 qkv, 576 o,
    3072 gate_up, 49152 the tied LM head; K 1536: N 576 down) at M = 1 and 8: the few-row kernel
    (csrc/linear_16bit.cpp) on its AVX512_BF16 path (where the CPU has it) and on its portable
    path, oneDNN (F.linear in bf16, what bf16 ran on before) and the float32 few-row kernel of the
    same shape. Weights cycled over copies (>= 64 MB of bf16 per shape) so every call streams them
    from memory; the four timed interleaved, `rounds` rounds, best median kept. GB/s: weight bytes
    per second (bf16: 2 per weight, float32: 4) against the read bandwidth of this run."""
    kernel = torch.ops.dlinfer_cpu.linear_few_rows_16bit
    f32 = torch.ops.dlinfer_cpu.linear_few_rows
    paths = {"bf16 dot": 1, "bf16 portable": 0} if torch.ops.dlinfer_cpu.linear_16bit_best_path() == 1 else \
        {"bf16 portable": 0}
    names = [*paths, "oneDNN bf16", "f32 kernel"]
    print("\n| N x K | M | " + " | ".join(f"{n} us (GB/s, of read bw)" for n in names) +
          " | oneDNN / best bf16 | f32 / best bf16 |")
    print("|---" * (4 + len(names)) + "|", flush=True)
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
        copies = max(2, (64 << 20) // (2 * n * k))
        wb = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        wf = [w.float() for w in wb]
        for m in (1, 8):
            xb = torch.randn(m, k).bfloat16()
            xf = xb.float()
            calls = {name: (lambda p=p: [kernel(xb, w, None, p) for w in wb]) for name, p in paths.items()}
            calls["oneDNN bf16"] = lambda: [F.linear(xb, w) for w in wb]
            calls["f32 kernel"] = lambda: [f32(xf, w, None) for w in wf]
            best = {name: float("inf") for name in calls}
            for _ in range(rounds):
                for name, fn in calls.items():
                    best[name] = min(best[name], timeit(fn, min_time=0.2) / copies)
            cells = []
            for name in names:
                gbs = n * k * (4 if name == "f32 kernel" else 2) / best[name]
                cells.append(f"{best[name] * 1e6:.1f} ({gbs / 1e9:.1f}, {gbs / bw:.2f})")
            top = min(best[name] for name in paths)
            print(f"| {n} x {k} | {m} | " + " | ".join(cells) + f" | {best['oneDNN bf16'] / top:.2f}x | "
                  f"{best['f32 kernel'] / top:.2f}x |", flush=True)


def w4_cases(bw):
    """W4A16 `weight_quant_matmul` on the cpu vendor at SmolLM2-135M's shapes (K 576: group 64, as
    576 is no multiple of 128; K 1536: group 128), canonical AWQ layout and the layout the
    vendor's load-time repack gives (column_tiled or k_interleaved, dlinfer/vendor/w4_layouts.py),
    against the float32 `linear` of the same shape. Each weight
    is cycled over copies of >= 64 MB in all, so every call streams it from memory; the three are
    timed interleaved, three rounds, best median kept. GB/s: packed weight + scale + zero-point
    bytes per second, against the read bandwidth measured in the same run."""
    from dlinfer.conformance.suites.weight_quant import W4Case, weights

    print("\n| M | K | N | g | W4 canonical ms | W4 repacked ms | GB/s (repacked) | of read bw | "
          "f32 linear ms | f32 / W4 repacked |")
    print("|---" * 10 + "|", flush=True)
    for k, n, g in ((576, 1536, 64), (576, 576, 64), (576, 49152, 64), (1536, 576, 128)):
        wbytes = k * n // 2 + (k // g) * n * 4 + (k // g) * n // 2
        sets = []
        for c in range(max(1, (64 << 20) // wbytes)):
            qw, sc, z, _ = weights(W4Case("bench", (1,), k, n, g), torch.float32, torch.Generator().manual_seed(c))
            sets.append(ops.repack_weight_quant(qw, sc, z, g) + (qw,))
        dense = [torch.randn(n, k) for _ in range(max(1, (64 << 20) // (4 * k * n)))]
        for m in (1, 8):
            x = torch.randn(m, k)
            calls = {
                "canonical": lambda: [ops.weight_quant_matmul(x, c, s, z, None, False, g) for _, s, z, c in sets],
                "tiled": lambda: [ops.weight_quant_matmul(x, t, s, z, None, False, g) for t, s, z, _ in sets],
                "f32": lambda: [ops.linear(x, w) for w in dense],
            }
            per = {"canonical": len(sets), "tiled": len(sets), "f32": len(dense)}
            best = {name: float("inf") for name in calls}
            for _ in range(3):
                for name, fn in calls.items():
                    best[name] = min(best[name], timeit(fn, min_time=0.3) / per[name])
            gbs = wbytes / best["tiled"]
            print(f"| {m} | {k} | {n} | {g} | {best['canonical'] * 1e3:.3f} | {best['tiled'] * 1e3:.3f} | "
                  f"{gbs / 1e9:.1f} | {gbs / bw:.2f} | {best['f32'] * 1e3:.3f} | {best['f32'] / best['tiled']:.2f}x |",
                  flush=True)


def w8a8_cases(vendors, bw, quick):
    """linear_w8a8 at decode: SmolLM2-135M's K = 576 against N = 1536 (MLP), 576 (attention) and
    49152 (the vocabulary), M = 1 and 8. Weights are cycled over copies (at least 64 MB of int8 per
    shape) so each call streams them from memory. Per vendor: ms per call, the int8 weight bytes
    read per second against the read bandwidth of this run, and float32 `linear` of the same
    shape on the same vendor (its weights cycled alike) / int8."""
    print("\n| linear_w8a8 N x K | M | " + " | ".join(f"{v} int8 ms | {v} GB/s (share of read bw) | "
                                                      f"{v} f32 linear ms | f32 / int8" for v in vendors) + " |")
    print("|---" * (2 + 4 * len(vendors)) + "|", flush=True)
    k = 576
    for n in (1536, 576, 49152):
        copies = max(2, (64 << 20) // (n * k))
        if quick:
            copies = max(2, copies // 4)
        wq = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
        wf = [torch.randn(n, k) for _ in range(copies)]
        lin = torch.rand(n) / 127
        for m in (1, 8):
            a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            rms, x = torch.rand(m) / 127, torch.randn(m, k)
            cells = []
            for v in vendors:
                with dlinfer.vendor.using(v):
                    t8 = timeit(lambda: [ops.linear_w8a8(a, w, rms, lin, torch.float32) for w in wq]) / copies
                    t32 = timeit(lambda: [ops.linear(x, w) for w in wf]) / copies
                gbs = n * k / t8
                cells += [f"{t8 * 1e3:.4f}", f"{gbs / 1e9:.1f} ({gbs / bw:.2f})", f"{t32 * 1e3:.4f}",
                          f"{t32 / t8:.2f}x"]
            print(f"| {n} x {k} | {m} | " + " | ".join(cells) + " |", flush=True)
        wq = wf = None  # freed before the next shape's copies are made


def run(quick: bool, vendors):
    torch.manual_seed(0)
    dtype = torch.float32
    bw, copy_bw = read_bandwidth(), copy_bandwidth()
    print(f"vendors {vendors}; CPU, {torch.get_num_threads()} threads, {dtype}; this machine, same run: "
          f"read bandwidth {bw / 1e9:.1f} GB/s, copy bandwidth {copy_bw / 1e9:.1f} GB/s\n")
    tab = Table(vendors, bw, copy_bw)

    linear_cases(tab, dtype)
    if "cpu" in vendors:
        with dlinfer.vendor.using("cpu"):
            w4_cases(bw)
            linear_16bit_cases(bw)
        print()
    w8a8_cases(vendors, bw, quick)
    tab = Table(vendors, bw, copy_bw)

    for tokens, label in ((8, "decode T=8"), (512, "prefill T=512")):
        x = torch.randn(tokens, H, dtype=dtype)
        w = torch.randn(H, dtype=dtype)
        tab.case("rms_norm", label, lambda: naive_rms_norm(x, w, 1e-6), lambda: ops.rms_norm(x, w, 1e-6))
        tab.case("add_rms_norm", label, lambda: (naive_rms_norm(x + x, w, 1e-6), x + x),
                 lambda: ops.add_rms_norm(x, x, w, 1e-6))
        q = torch.randn(tokens, HQ, D, dtype=dtype)
        k = torch.randn(tokens, HKV, D, dtype=dtype)
        cos, sin = torch.randn(tokens, D, dtype=dtype), torch.randn(tokens, D, dtype=dtype)
        tab.case("apply_rotary_pos_emb", label, lambda: naive_rotary(q, k, cos, sin),
                 lambda: ops.apply_rotary_pos_emb(q, k, cos, sin))
        gu = torch.randn(tokens, 2 * (INTER // 4), dtype=dtype)
        tab.case("silu_and_mul", label + " I/4", lambda: F.silu(gu[:, : INTER // 4]) * gu[:, INTER // 4:],
                 lambda: ops.silu_and_mul(gu))
        nb = tokens // BS + 8
        kc = torch.zeros(nb, BS, HKV, D, dtype=dtype)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(nb * BS)[:tokens]
        kv = torch.randn(tokens, HKV, D, dtype=dtype)
        tab.case("fill_kv_cache", label, lambda: naive_fill(kv, kv, kc, vc, slots),
                 lambda: ops.fill_kv_cache(kv, kv, kc, vc, slots))

    scale = D ** -0.5
    for batch, ctx in ((1, 2048), (8, 1024)) if not quick else ((8, 512),):
        q, kc, vc, table, cu, kv_lens = paged_setup(batch, ctx, 1, dtype)
        kv_bytes = 2 * batch * ctx * HKV * D * kc.element_size()
        tab.case("paged_decode_attention", f"B={batch} ctx={ctx}",
                 lambda: naive_paged(q, kc, vc, table, cu, kv_lens, scale),
                 lambda: ops.paged_decode_attention(q, kc, vc, table, BS, cu[1:], kv_lens, ctx, HQ, HKV), kv_bytes)
    batch, ctx, new = 2, 768, 256
    q, kc, vc, table, cu, kv_lens = paged_setup(batch, ctx, new, dtype)
    tab.case("paged_prefill_attention", f"B={batch} new={new} ctx={ctx}",
             lambda: naive_paged(q, kc, vc, table, cu, kv_lens, scale),
             lambda: ops.paged_prefill_attention(q, None, None, kc, vc, table, BS, cu[1:], kv_lens, new, ctx, HQ,
                                                 HKV, []))
    lens = torch.tensor([300, 212], dtype=torch.int32)
    t = int(lens.sum())
    q, k, v = (torch.randn(t, HQ, D, dtype=dtype), torch.randn(t, HKV, D, dtype=dtype),
               torch.randn(t, HKV, D, dtype=dtype))

    def naive_prefill():
        out, s = torch.empty_like(q), 0
        for n in lens.tolist():
            out[s:s + n] = naive_attention_one(q[s:s + n], k[s:s + n], v[s:s + n], scale)
            s += n
        return out

    tab.case("prefill_attention", "B=2 T=512", naive_prefill,
             lambda: ops.prefill_attention(q, k, v, None, None, lens, lens, 300, HQ, HKV, []))

    e, topk, hm, im = 8, 2, 1024, 1792  # Mixtral-like, scaled 1/4 in H and 1/8 in I
    for tokens, label in ((8, "decode T=8"), (128, "prefill T=128")):
        logits = torch.randn(tokens, e, dtype=dtype)
        tab.case("moe_gating_topk_softmax", label, lambda: torch.topk(torch.softmax(logits.float(), -1), topk, -1),
                 lambda: ops.moe_gating_topk_softmax(logits, topk))
        x = torch.randn(tokens, hm, dtype=dtype)
        gate_up = torch.randn(e, 2 * im, hm, dtype=dtype) * 0.02
        down = torch.randn(e, hm, im, dtype=dtype) * 0.02
        w, ids = ops.moe_gating_topk_softmax(logits, topk)
        tab.case("fused_moe", label + f" E={e} H={hm} I={im}", lambda: naive_moe(x, gate_up, down, w, ids),
                 lambda: ops.fused_moe(x, gate_up, down, w, ids, topk, False))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer attention sizes, fewer W8A8 weight copies")
    parser.add_argument("--only-w8a8", action="store_true", help="the read bandwidth and the W8A8 table only")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--vendors", default=None, help="comma-separated (default: the CPU vendors that load)")
    parser.add_argument("--w4-only", action="store_true", help="only the W4A16 table (cpu vendor)")
    parser.add_argument("--prefill-only", action="store_true",
                        help="only the prefill attention table (SmolLM2 heads, T = 32 .. 2048)")
    parser.add_argument("--bf16-only", action="store_true", help="only the bfloat16 few-row linear table (cpu vendor)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    present = [v for v in ("torch", "cpu") if v in dlinfer.vendor.available()]
    names = args.vendors.split(",") if args.vendors else present
    if args.prefill_only:
        prefill_cases(names)
    elif args.bf16_only:
        read_bw = read_bandwidth()
        print(f"bfloat16 linear, cpu vendor; CPU, {torch.get_num_threads()} threads; read bandwidth "
              f"{read_bw / 1e9:.1f} GB/s (this machine, same run)")
        dlinfer.vendor.load("cpu")
        linear_16bit_cases(read_bw)
    elif args.w4_only:
        read_bw = read_bandwidth()
        print(f"W4A16, cpu vendor; CPU, {torch.get_num_threads()} threads; read bandwidth {read_bw / 1e9:.1f} GB/s "
              "(this machine, same run)")
        with dlinfer.vendor.using("cpu"):
            w4_cases(read_bw)
    elif args.only_w8a8:
        bandwidth = read_bandwidth()
        print(f"vendors {names}; CPU, {torch.get_num_threads()} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s")
        w8a8_cases(names, bandwidth, args.quick)
    else:
        run(args.quick, names)
