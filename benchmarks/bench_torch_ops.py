"""Torch-vendor ops against naive per-sequence / per-token PyTorch, on this machine's CPU (or GPU).

Prints, per op and size, the median time of dlinfer's public op (torch vendor, checks included)
and of a naive implementation of the same math, and their ratio (naive / dlinfer: > 1 means
dlinfer is faster). For paged decode attention it also prints the achieved K/V read bandwidth
against this machine's copy bandwidth measured in the same run.

Sizes are a 7B-class layer (Llama-3-8B: H 4096, Hq 32, Hkv 8, D 128, I 14336) scaled down in
batch/context so that a 2-core CPU finishes in about a minute.

    .venv/bin/python benchmarks/bench_torch_ops.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dlinfer.ops as ops
import dlinfer.vendor as vendor

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


def copy_bandwidth(nbytes=256 << 20):
    """Bytes copied per second by a large tensor copy (source bytes / time)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
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


# ---------------------------------------------------------------- cases
def paged_setup(batch, ctx, new, dtype):
    num_blocks_seq = (ctx + BS - 1) // BS
    nb = batch * num_blocks_seq + 3
    kc = torch.randn(nb, BS, HKV, D, dtype=dtype)
    vc = torch.randn(nb, BS, HKV, D, dtype=dtype)
    table = torch.randperm(nb)[: batch * num_blocks_seq].view(batch, num_blocks_seq).int()
    q = torch.randn(batch * new, HQ, D, dtype=dtype)
    kv_lens = torch.full((batch,), ctx, dtype=torch.int32)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32)
    return q, kc, vc, table, cu, kv_lens


def run(quick: bool):
    torch.manual_seed(0)
    dtype = torch.float32
    print(f"vendor: {vendor.current().name}; device cpu; threads {torch.get_num_threads()}; dtype {dtype}")
    bw = copy_bandwidth()
    print(f"copy bandwidth (this machine, same run): {bw / 1e9:.2f} GB/s\n")
    rows = []

    def case(name, size, fast, slow, note=""):
        t_fast, t_slow = timeit(fast), timeit(slow)
        rows.append((name, size, t_fast, t_slow, note))
        print(f"{name:<24} {size:<26} dlinfer {t_fast * 1e3:9.3f} ms  naive {t_slow * 1e3:9.3f} ms"
              f"  ratio {t_slow / t_fast:6.2f}x {note}", flush=True)

    for tokens, label in ((8, "decode T=8"), (512, "prefill T=512")):
        x = torch.randn(tokens, H, dtype=dtype)
        w = torch.randn(H, dtype=dtype)
        case("rms_norm", label, lambda: ops.rms_norm(x, w, 1e-6), lambda: naive_rms_norm(x, w, 1e-6))
        case("add_rms_norm", label, lambda: ops.add_rms_norm(x, x, w, 1e-6),
             lambda: (naive_rms_norm(x + x, w, 1e-6), x + x))
        q = torch.randn(tokens, HQ, D, dtype=dtype)
        k = torch.randn(tokens, HKV, D, dtype=dtype)
        cos, sin = torch.randn(tokens, D, dtype=dtype), torch.randn(tokens, D, dtype=dtype)
        case("apply_rotary_pos_emb", label, lambda: ops.apply_rotary_pos_emb(q, k, cos, sin),
             lambda: naive_rotary(q, k, cos, sin))
        gu = torch.randn(tokens, 2 * (INTER // 4), dtype=dtype)
        case("silu_and_mul", label + " I/4", lambda: ops.silu_and_mul(gu),
             lambda: F.silu(gu[:, : INTER // 4]) * gu[:, INTER // 4:])
        nb = tokens // BS + 8
        kc = torch.zeros(nb, BS, HKV, D, dtype=dtype)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(nb * BS)[:tokens]
        kv = torch.randn(tokens, HKV, D, dtype=dtype)
        case("fill_kv_cache", label, lambda: ops.fill_kv_cache(kv, kv, kc, vc, slots),
             lambda: naive_fill(kv, kv, kc, vc, slots))

    scale = D ** -0.5
    for batch, ctx in ((1, 2048), (8, 1024)) if not quick else ((8, 512),):
        q, kc, vc, table, cu, kv_lens = paged_setup(batch, ctx, 1, dtype)
        kv_bytes = 2 * batch * ctx * HKV * D * kc.element_size()
        fast = lambda: ops.paged_decode_attention(q, kc, vc, table, BS, cu[1:], kv_lens, ctx, HQ, HKV)
        t = timeit(fast)
        case("paged_decode_attention", f"B={batch} ctx={ctx}", fast,
             lambda: naive_paged(q, kc, vc, table, cu, kv_lens, scale),
             f"| K/V {kv_bytes / t / 1e9:.2f} GB/s = {kv_bytes / t / bw:.2f} of copy bw")
    batch, ctx, new = 2, 768, 256
    q, kc, vc, table, cu, kv_lens = paged_setup(batch, ctx, new, dtype)
    case("paged_prefill_attention", f"B={batch} new={new} ctx={ctx}",
         lambda: ops.paged_prefill_attention(q, None, None, kc, vc, table, BS, cu[1:], kv_lens, new, ctx, HQ, HKV, []),
         lambda: naive_paged(q, kc, vc, table, cu, kv_lens, scale))
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

    case("prefill_attention", "B=2 T=512", lambda: ops.prefill_attention(q, k, v, None, None, lens, lens, 300, HQ, HKV, []),
         naive_prefill)

    e, topk, hm, im = 8, 2, 1024, 1792  # Mixtral-like, scaled 1/4 in H and 1/8 in I
    for tokens, label in ((8, "decode T=8"), (128, "prefill T=128")):
        logits = torch.randn(tokens, e, dtype=dtype)
        case("moe_gating_topk_softmax", label, lambda: ops.moe_gating_topk_softmax(logits, topk),
             lambda: torch.topk(torch.softmax(logits.float(), -1), topk, -1))
        x = torch.randn(tokens, hm, dtype=dtype)
        gate_up = torch.randn(e, 2 * im, hm, dtype=dtype) * 0.02
        down = torch.randn(e, hm, im, dtype=dtype) * 0.02
        w, ids = ops.moe_gating_topk_softmax(logits, topk)
        case("fused_moe", label + f" E={e} H={hm} I={im}", lambda: ops.fused_moe(x, gate_up, down, w, ids, topk, False),
             lambda: naive_moe(x, gate_up, down, w, ids))
    x = torch.randn(8, H, dtype=dtype)
    wt = torch.randn(H // 2, H, dtype=dtype)
    case("linear", "decode T=8 N=H/2", lambda: ops.linear(x, wt), lambda: x @ wt.t())
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer attention sizes")
    run(parser.parse_args().quick)
