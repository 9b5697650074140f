"""The triton vendor's KV-cache ops on a cache too large for 32-bit element offsets (a GPU check).

    python benchmarks/gpu_big_cache.py [--dtype bfloat16] [--json FILE]      # CUDA
    TRITON_INTERPRET=1 python benchmarks/gpu_big_cache.py --dry-run          # CPU, tiny

Decode at batch 64 x 4096 tokens of context (Hq 32, Hkv 8, D 128, block size 64) over a cache of
36864 blocks (2 x 4.8 GB in bf16): each block holds 64 x 8 x 128 = 2**16 elements, so every block
id from 32768 up starts beyond 2**31 elements. The sequences' 4096 blocks are exactly those top
ids, shuffled, so an index computed in int32 anywhere in fill_kv_cache, paged_decode_attention or
paged_prefill_attention reads or writes the wrong place.

Checks (the tolerance table's bound for attention, dlinfer/tools/tolerances.py):
- fill_kv_cache writes every token where the block table says (read back by torch, exact);
- paged_decode_attention's output equals a float64 reference computed from the keys and values
  themselves (not from the cache), so the cache's addressing is what is tested;
- paged_prefill_attention: the last 16 tokens of each sequence as new tokens over the rest.
The dry run does the same at tiny sizes on the CPU (no 2**31 offsets: it checks the script).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import require_interpreter, write_json  # noqa: E402

FULL = dict(batch=64, ctx=4096, hq=32, hkv=8, d=128, bs=64, blocks=36864, new=16)
TINY = dict(batch=3, ctx=48, hq=4, hkv=2, d=16, bs=16, blocks=24, new=5)


def reference(q, k, v, scale, causal_from=None):
    """float64 attention of one sequence: q [Tq, Hq, D] over k, v [Tk, Hkv, D] (GQA by head
    groups). causal_from: query i sees keys < causal_from + i + 1 (None: all keys)."""
    hq, hkv = q.shape[1], k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(hq // hkv, 1), v.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    if causal_from is not None:
        tq, tk = q.shape[0], k.shape[0]
        last_key = causal_from + torch.arange(tq, device=q.device)  # query i sees keys 0..last_key[i]
        visible = torch.arange(tk, device=q.device)[None, :] <= last_key[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vd)


def within(out, ref, dtype) -> tuple:
    """(ok, worst |out - ref| / (atol + rtol |ref|)) under the table's attention bound."""
    from dlinfer.tools.tolerances import TOLERANCES

    atol, rtol = TOLERANCES[(dtype, "reduction")]
    ratio = float(((out.double() - ref).abs() / (atol + rtol * ref.abs())).max())
    return ratio <= 1.0, ratio


def run(cfg, dtype, device) -> dict:
    from dlinfer.vendor.triton import attention, kv_cache

    b, ctx, hq, hkv, d, bs, nb, new = (cfg[k] for k in ("batch", "ctx", "hq", "hkv", "d", "bs", "blocks", "new"))
    assert ctx % bs == 0, "whole blocks: the read-back views the blocks as the sequence"
    per_seq = ctx // bs
    used = b * per_seq
    assert used <= nb
    g = torch.Generator(device=device).manual_seed(0)
    top = torch.arange(nb - used, nb, device=device)
    table = top[torch.randperm(used, generator=g, device=device)].view(b, per_seq).to(torch.int32)
    result = {"config": cfg, "dtype": str(dtype), "block_elements": bs * hkv * d,
              "highest_element_offset": int(nb * bs * hkv * d - 1),
              "lowest_used_block_offset": int((nb - used) * bs * hkv * d)}
    k_cache = torch.empty(nb, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    keys = torch.randn(b, ctx, hkv, d, generator=g, device=device).to(dtype)
    values = torch.randn(b, ctx, hkv, d, generator=g, device=device).to(dtype)
    pos = torch.arange(ctx, device=device)
    slots = (table[:, pos // bs] * bs + pos % bs).reshape(-1).to(torch.int32)  # [b * ctx]
    t0 = time.perf_counter()
    kv_cache.fill_kv_cache(keys.view(-1, hkv, d), values.view(-1, hkv, d), k_cache, v_cache, slots, "token_major")
    got_k = k_cache[table.long()].view(b, ctx, hkv, d)  # the blocks in table order = the sequence
    got_v = v_cache[table.long()].view(b, ctx, hkv, d)
    result["fill_kv_cache_exact"] = bool(torch.equal(got_k, keys) and torch.equal(got_v, values))
    del got_k, got_v
    scale = d ** -0.5
    kv_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)

    q = torch.randn(b, hq, d, generator=g, device=device).to(dtype)
    out = torch.empty_like(q)
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    attention.paged_decode_attention(q, k_cache, v_cache, table, cu, kv_lens, ctx, scale, None, out, "token_major")
    worst = 0.0
    for i in range(b):
        ok, ratio = within(out[i:i + 1], reference(q[i:i + 1], keys[i], values[i], scale), dtype)
        worst = max(worst, ratio)
    result["decode_worst_error_over_bound"] = worst
    result["decode_ok"] = worst <= 1.0

    qp = torch.randn(b * new, hq, d, generator=g, device=device).to(dtype)
    outp = torch.empty_like(qp)
    cu_p = torch.arange(0, b * new + 1, new, dtype=torch.int32, device=device)
    attention.paged_prefill_attention(qp, k_cache, v_cache, table, cu_p, kv_lens, new, ctx, scale, None, outp,
                                      "token_major")
    worst = 0.0
    for i in range(b):
        ref = reference(qp[i * new:(i + 1) * new], keys[i], values[i], scale, causal_from=ctx - new)
        worst = max(worst, within(outp[i * new:(i + 1) * new], ref, dtype)[1])
    result["prefill_worst_error_over_bound"] = worst
    result["prefill_ok"] = worst <= 1.0
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    result["seconds"] = time.perf_counter() - t0
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes")
    args = ap.parse_args(argv)
    if args.dry_run:
        require_interpreter()
        cfg, device = TINY, "cpu"
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_big_cache.py needs a CUDA GPU (or --dry-run)")
        cfg, device = FULL, "cuda"
    res = run(cfg, getattr(torch, args.dtype), device)
    res["beyond_int32"] = res["lowest_used_block_offset"] >= 2**31
    ok = res["fill_kv_cache_exact"] and res["decode_ok"] and res["prefill_ok"]
    res["ok"] = ok
    print(f"big cache ({cfg['blocks']} blocks, used ids from {cfg['blocks'] - cfg['batch'] * cfg['ctx'] // cfg['bs']}; "
          f"offsets beyond 2**31: {res['beyond_int32']}): fill exact {res['fill_kv_cache_exact']}, "
          f"decode worst |err|/bound {res['decode_worst_error_over_bound']:.2f}, prefill "
          f"{res['prefill_worst_error_over_bound']:.2f} -> {'PASS' if ok else 'FAIL'}")
    write_json(args.json, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
