"""Kernel-level tests of the triton vendor's attention (the op parity suite lives in tests/ops).

What only the kernels can get wrong: the split-KV rule and multi-segment reductions of decode,
empty segments and empty sequences, int64 cache offsets, block ids that must never be read,
bad metadata that must never make a kernel read or write outside its tensors, an output that
aliases the query (LMDeploy passes query[..., :Dv]). The reference is dense fp64 math written
here. Small shapes: everything runs through TRITON_INTERPRET=1 without a GPU.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

from dlinfer.vendor.triton import attention as A  # noqa: E402
from dlinfer.vendor.triton import attention_decode as AD  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
EPS_MULT = {torch.float32: 32, torch.float16: 2, torch.bfloat16: 2}  # as dlinfer/tools/tolerances.py


# ---------------------------------------------------------------- reference and fixtures


def reference(q, k, v, q_pos, scale, slopes):
    """q [n, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv]; row i sees keys 0..q_pos[i]. fp64."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for i, p in enumerate(q_pos):
        for h in range(q.shape[1]):
            s = k[: p + 1, h // g] @ q[i, h] * scale
            if slopes is not None:
                s = s + float(slopes[h]) * (torch.arange(p + 1, dtype=torch.float64) - p)
            out[i, h] = torch.softmax(s, 0) @ v[: p + 1, h // g]
    return out


def paged_batch(new, hist, hq, hkv, d, dv, bs, layout, dtype, index_dtype, seed=0):
    """A batch of sequences in a paged cache: shuffled blocks, garbage in unused table entries,
    NaN in every block no sequence uses (block 0 among them) and in the slots past each
    sequence's end: a key or value read without its mask poisons the output."""
    g = torch.Generator().manual_seed(seed)
    kv = [n + h for n, h in zip(new, hist)]
    nblk = [(x + bs - 1) // bs for x in kv]
    m, nb = max(nblk) + 2, sum(nblk) + 6
    shape = (lambda x: (nb, bs, hkv, x)) if layout == "token_major" else (lambda x: (nb, hkv, bs, x))
    kc, vc = torch.randn(shape(d), generator=g).to(dtype), torch.randn(shape(dv), generator=g).to(dtype)
    table = torch.randint(-(2**30), 2**30, (len(kv), m), generator=g)
    perm, c, ks, vs = 1 + torch.randperm(nb - 1, generator=g), 0, [], []
    for b, x in enumerate(kv):
        ids = perm[c : c + nblk[b]]
        c += nblk[b]
        table[b, : nblk[b]] = ids
        kb, vb = kc[ids], vc[ids]
        if layout == "head_major":
            kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)
        ks.append(kb.reshape(-1, hkv, d)[:x])
        vs.append(vb.reshape(-1, hkv, dv)[:x])
        if x % bs:
            tail = ((ids[-1], slice(None), slice(x % bs, None)) if layout == "head_major"
                    else (ids[-1], slice(x % bs, None)))
            kc[tail] = float("nan")
            vc[tail] = float("nan")
    kc[0] = vc[0] = float("nan")
    kc[perm[c:]] = float("nan")
    vc[perm[c:]] = float("nan")
    query = torch.randn(sum(new), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    ref = torch.zeros(sum(new), hq, dv, dtype=torch.float64)
    slopes = torch.rand(hq, generator=g) * 0.3
    return dict(query=query, kc=kc, vc=vc, table=table.to(index_dtype), cu=cu, kv=kv, ks=ks, vs=vs, ref=ref,
                slopes=slopes)


def expected(bt, scale, alibi):
    for b in range(len(bt["kv"])):
        s, e = int(bt["cu"][b]), int(bt["cu"][b + 1])
        if e > s:
            pos = [bt["kv"][b] - (e - s) + i for i in range(e - s)]
            bt["ref"][s:e] = reference(bt["query"][s:e], bt["ks"][b], bt["vs"][b], pos, scale,
                                       bt["slopes"] if alibi else None)
    return bt["ref"]


def to_dev(bt):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in bt.items()}


def assert_close(out, ref, dtype, what):
    out = out.double().cpu()
    err = (out - ref).abs()
    tol = EPS_MULT[dtype] * EPS[dtype] * (1 + ref.abs())
    bad = ~(err <= tol)
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{bad.numel()} elements off, max |err| "
                           f"{err.max().item():.3e} at {tuple(int(i) for i in bad.nonzero()[0])}; "
                           f"tolerance {EPS_MULT[dtype]} eps of {dtype}")


# ---------------------------------------------------------------- split rule


def test_split_rule():
    f = AD.num_kv_splits
    assert f(256, 8, 4096, 132) == 1  # 2048 programs already fill an H100
    assert f(64, 8, 4096, 132) == 2  # 512 programs: ~4 per SM wanted
    assert f(8, 8, 1024, 132) == 8  # wants 9, capped at 1024 / 128 keys per segment
    assert f(1, 8, 1 << 20, 132) == AD.MAX_SPLITS
    assert f(4, 8, 100, 132) == 1  # short context: never below 128 keys per segment
    assert f(3, 2, 50, 1) == 1  # CPU (1 "SM"): no split
    for t in (1, 3, 17, 200):
        for ctx in (1, 127, 129, 255, 257, 5000, 70000):
            s = f(t, 4, ctx, 108)
            assert 1 <= s <= AD.MAX_SPLITS and (s == 1 or (ctx + s - 1) // s >= AD.MIN_KEYS_PER_SPLIT // 2)
    # the launcher's plan: whole tiles per segment, no empty trailing split
    assert AD.split_plan(4096, 2, 128) == (2, 2048, 64)
    assert AD.split_plan(100, 5, 128) == (4, 32, 32)
    assert AD.split_plan(0, 7, 128) == (1, 16, 16)


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize(
    "splits, new, dtype, hq, hkv, d, dv, bs, layout, index_dtype, alibi",
    [
        (1, (2, 0, 1, 3), torch.float32, 4, 4, 64, 64, 16, "token_major", torch.int32, False),
        (2, (2, 0, 1, 3), torch.float16, 8, 2, 80, 80, 4, "head_major", torch.int64, True),
        (5, (2, 0, 1, 3), torch.bfloat16, 10, 2, 64, 80, 16, "token_major", torch.int64, False),
        (4, (2, 2, 2, 2), torch.float32, 5, 1, 80, 64, 4, "head_major", torch.int32, True),
        (3, (1, 1, 1, 1), torch.float16, 4, 2, 64, 64, 16, "token_major", torch.int32, False),
    ],
)
def test_decode_segments(splits, new, dtype, hq, hkv, d, dv, bs, layout, index_dtype, alibi):
    """Multi-segment decode: speculative tokens (n_b up to 3), an empty sequence in the batch
    (the in-kernel binary search), equal token counts (the in-kernel guess), sequences much
    shorter than max_kv_seq_len (empty segments)."""
    new, hist = list(new), [70, 5, 0, 9]
    bt = paged_batch(new, hist, hq, hkv, d, dv, bs, layout, dtype, index_dtype, seed=splits)
    scale = d**-0.5
    ref = expected(bt, scale, alibi)
    x = to_dev(bt)
    out = torch.full((sum(new), hq, dv), float("nan"), dtype=dtype, device=DEVICE)
    AD.paged_decode(x["query"], x["kc"], x["vc"], x["table"], x["cu"], torch.tensor(bt["kv"], dtype=torch.int32,
                    device=DEVICE), max(bt["kv"]), scale, x["slopes"] if alibi else None, out, layout,
                    num_splits=splits)
    assert (AD.split_plan(max(bt["kv"]), splits, 128)[0] > 1) == (splits > 1)  # the segments really split
    assert_close(out, ref, dtype, f"decode, {splits} splits")


# ---------------------------------------------------------------- prefill, aliasing output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_and_aliased_output(dtype):
    """Paged prefill (history not a multiple of BS, empty sequence, GQA 5) writing into
    query[..., :Dv], as LMDeploy does; then decode and no-cache prefill the same way."""
    hq, hkv, d, dv, bs = 10, 2, 80, 64, 4
    new, hist = [3, 0, 5, 1], [6, 2, 0, 13]
    bt = paged_batch(new, hist, hq, hkv, d, dv, bs, "token_major", dtype, torch.int64, seed=7)
    ref = expected(bt, 0.3, True).clone()
    x = to_dev(bt)
    kv = torch.tensor(bt["kv"], dtype=torch.int32, device=DEVICE)
    for run in ("paged_prefill", "decode"):
        q = x["query"].clone()
        out = q[..., :dv]
        if run == "paged_prefill":
            A.paged_prefill_attention(q, x["kc"], x["vc"], x["table"], x["cu"], kv, max(new), max(bt["kv"]), 0.3,
                                      x["slopes"], out, "token_major")
        else:
            AD.paged_decode(q, x["kc"], x["vc"], x["table"], x["cu"], kv, max(bt["kv"]), 0.3, x["slopes"], out,
                            "token_major", num_splits=3)
        assert_close(out, ref, dtype, run)
        assert torch.equal(q[..., dv:], x["query"][..., dv:])

    # no cache: the new tokens alone
    g = torch.Generator().manual_seed(3)
    key = torch.randn(sum(new), hkv, d, generator=g).to(dtype)
    value = torch.randn(sum(new), hkv, dv, generator=g).to(dtype)
    ref = torch.zeros(sum(new), hq, dv, dtype=torch.float64)
    for b in range(len(new)):
        s, e = int(bt["cu"][b]), int(bt["cu"][b + 1])
        if e > s:
            ref[s:e] = reference(bt["query"][s:e], key[s:e], value[s:e], list(range(e - s)), 0.3, None)
    q = x["query"].clone()
    A.prefill_attention(q, key.to(DEVICE), value.to(DEVICE), x["cu"], max(new), 0.3, None, q[..., :dv])
    assert_close(q[..., :dv], ref, dtype, "prefill")


# ---------------------------------------------------------------- metadata that must not be trusted
# These run in a subprocess: a kernel that reads or writes out of bounds may crash the process
# (the interpreter segfaults) instead of failing an assert.


def _isolated(check: str) -> None:
    code = f"import runpy; runpy.run_path({os.path.abspath(__file__)!r})[{check!r}](); print('ok')"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-2000:], r.stderr[-4000:])


def _bad_metadata_check():
    hq, hkv, d, bs = 4, 2, 64, 4
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(5, bs, hkv, d, generator=g).to(DEVICE)
    vc = torch.randn(5, bs, hkv, d, generator=g).to(DEVICE)
    table = torch.tensor([[4, 10**9, -(10**9)], [2**31 - 1, 0, 1]], dtype=torch.int64, device=DEVICE)
    kv = torch.tensor([10**6, 7], dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, hq, d, generator=g).to(DEVICE)
    buf = torch.full((6, hq, d), 7.0, device=DEVICE)
    out = buf[1:5]
    for cu in ([0, 2, 9], [0, -3, 4], [5, 1, 3]):  # T is 4
        cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        AD.paged_decode(q, kc, vc, table, cu, kv, 8, d**-0.5, None, out, "token_major", num_splits=2)
        A.paged_prefill_attention(q, kc, vc, table, cu, kv, 9, 8, d**-0.5, None, out, "token_major")
        A.prefill_attention(q, kc[0], vc[0], cu, 9, d**-0.5, None, out)
        assert torch.isfinite(out).all()
        assert (buf[0] == 7).all() and (buf[5] == 7).all()


def test_bad_metadata_stays_in_bounds():
    """Used block ids out of range, kv_seq_len beyond M*BS, cu_seqlens_q not ending at T: the
    values are wrong, but no kernel may read outside the cache or write outside `out`."""
    _isolated("_bad_metadata_check")


def _int64_check():
    nb, bs, d = 2**21 + 8, 16, 64  # 2**31 + 8192 elements: block_id * block_stride needs int64
    cache = torch.empty(nb, bs, 1, d, dtype=torch.float16, device=DEVICE)  # untouched pages: no memory on CPU
    ids = torch.tensor([nb - 1, 3, nb - 5], device=DEVICE)
    g = torch.Generator().manual_seed(0)
    cache[ids] = torch.randn(3, bs, 1, d, generator=g).half().to(DEVICE)
    q = torch.randn(2, 2, d, generator=g).half().to(DEVICE)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    kv = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    k = cache[ids].reshape(-1, 1, d)[:40]
    ref = reference(q, k, k, [38, 39], d**-0.5, None)
    for run in ("decode", "prefill"):
        out = torch.empty(2, 2, d, dtype=torch.float16, device=DEVICE)
        if run == "decode":
            AD.paged_decode(q, cache, cache, ids.view(1, 3), cu, kv, 40, d**-0.5, None, out, "token_major",
                            num_splits=2)
        else:
            A.paged_prefill_attention(q, cache, cache, ids.view(1, 3).int(), cu, kv, 2, 40, d**-0.5, None, out,
                                      "token_major")
        assert_close(out, ref, torch.float16, f"{run} at block ids near 2**21")


def test_int64_cache_offsets():
    """A cache of 2**31+ elements read at its last blocks (int32 offsets would wrap)."""
    _isolated("_int64_check")


# ---------------------------------------------------------------- prefill's unmasked key tiles


def test_prefill_tiles_widen_only_at_head_dim_128_in_half_precision():
    """`wide` (sm_90 / sm_100) gives 128 x 128 tiles at head dim 128 in fp16 / bf16 alone: not in
    fp32 or with an int8 cache (both pass fp32=True), not at other head dims (unmeasured)."""
    from dlinfer.vendor.triton import attention_prefill as P

    assert P._tiles(2048, 2048, 128, 128, False, wide=True)[:2] == (128, 128)
    assert P._tiles(2048, 2048, 128, 128, False, wide=False)[:2] == (128, 64)
    assert P._tiles(2048, 2048, 128, 128, True, wide=True)[:2] == (64, 32)
    for d in (64, 80, 96, 192, 256, 576):
        assert P._tiles(2048, 2048, d, d, False, wide=True) == P._tiles(2048, 2048, d, d, False), d
    assert P._tiles(40, 100, 128, 128, False, wide=True)[:2] == (64, 128)  # still capped by the lengths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_with_wide_tiles(dtype, monkeypatch):
    """The 128 x 128 tiles sm_90 takes at head dim 128, run here: two query tiles of one sequence,
    a history past one key tile, GQA 2, against the fp64 reference."""
    from dlinfer.vendor.triton import attention_prefill as P

    monkeypatch.setattr(P, "hopper", lambda device: True)
    hq, hkv, d, bs = 4, 2, 128, 16
    new, hist = [140, 3], [70, 200]
    bt = paged_batch(new, hist, hq, hkv, d, d, bs, "token_major", dtype, torch.int32, seed=5)
    assert P._tiles(max(new), max(bt["kv"]), d, d, False, True)[:2] == (128, 128)
    x = to_dev(bt)
    kv = torch.tensor(bt["kv"], dtype=torch.int32, device=DEVICE)
    out = torch.full((sum(new), hq, d), float("nan"), dtype=dtype, device=DEVICE)
    A.paged_prefill_attention(x["query"], x["kc"], x["vc"], x["table"], x["cu"], kv, max(new), max(bt["kv"]), 0.3,
                              None, out, "token_major")
    assert_close(out, expected(bt, 0.3, False), dtype, "wide tiles")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("extra", ["plain", "alibi", "softcap", "int8 cache", "window"])
def test_prefill_mask_split_gives_the_same_bits(dtype, layout, extra, monkeypatch):
    """mask_split: the key tiles every row sees skip the mask, which there only ever kept the
    scores as they were; so the output is the masked walk's, bit for bit, and within tolerance of
    the fp64 reference. Histories of 100+ keys: at these tiles (32 x 64; fp32 and the int8 cache
    32 x 32) the first program's rows all see its first 1-2 key tiles (3-4 at 32 keys). Packed K/V:
    a 150-token sequence, whose second and third programs (128 or 64 rows) see earlier tiles whole."""
    from dlinfer.vendor.triton import attention_prefill as P

    hq, hkv, d, dv, bs = 4, 2, 64, 64, 16
    new, hist = [20, 3, 0, 17], [100, 130, 5, 0]
    bt = paged_batch(new, hist, hq, hkv, d, dv, bs, layout, dtype, torch.int32, seed=11)
    x = to_dev(bt)
    kv = torch.tensor(bt["kv"], dtype=torch.int32, device=DEVICE)
    kwargs = {}
    if extra == "softcap":
        kwargs["softcap"] = 5.0
    if extra == "window":
        kwargs["window"] = 37
    kc, vc = x["kc"], x["vc"]
    if extra == "int8 cache":
        kc = torch.nan_to_num(kc.float() * 20).clamp(-127, 127).to(torch.int8)
        vc = torch.nan_to_num(vc.float() * 20).clamp(-127, 127).to(torch.int8)
        kwargs["quant"] = tuple(torch.full((hkv,), v, device=DEVICE) for v in (0.05, 1.0, 0.05, -2.0))
    alibi = x["slopes"] if extra == "alibi" else None
    outs = []
    for split in (False, True):
        monkeypatch.setattr(P, "mask_split", lambda split=split: split)
        out = torch.full((sum(new), hq, dv), float("nan"), dtype=dtype, device=DEVICE)
        P.paged_prefill(x["query"], kc, vc, x["table"], x["cu"], kv, max(new), max(bt["kv"]), 0.3, alibi, out,
                        layout, **kwargs)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    if extra in ("plain", "alibi"):
        assert_close(outs[1], expected(bt, 0.3, extra == "alibi"), dtype, f"split prefill, {extra}")
    if extra == "int8 cache":
        return
    # no cache: the new tokens alone, both walks
    packed = [150, 5]
    g = torch.Generator().manual_seed(3)
    query = torch.randn(sum(packed), hq, d, generator=g).to(dtype).to(DEVICE)
    key = torch.randn(sum(packed), hkv, d, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(sum(packed), hkv, dv, generator=g).to(dtype).to(DEVICE)
    cu = torch.tensor([0, 150, 155], dtype=torch.int32, device=DEVICE)
    outs = []
    for split in (False, True):
        monkeypatch.setattr(P, "mask_split", lambda split=split: split)
        out = torch.empty(sum(packed), hq, dv, dtype=dtype, device=DEVICE)
        P.prefill(query, key, value, cu, max(packed), 0.3, alibi, out, **kwargs)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    if extra == "plain":
        ref = reference(query[:150], key[:150], value[:150], list(range(150)), 0.3, None)
        assert_close(outs[1][:150], ref, dtype, "split prefill without a cache")


def _bad_metadata_split_check():
    """The checks above with the split, and packed K/V of 4 tokens under cu_seqlens_q claiming 200:
    the programs past the first would walk keys 0..63 (or more) unmasked but for the split's bound
    by T - q_start, which leaves them to the masked walk. Those programs store no row, and the
    interpreter does not fault on a read past a tensor, so what this catches is a wrong write or
    value; the read bound itself is argued in the kernel."""
    from dlinfer.vendor.triton import attention_prefill as P

    P.mask_split = lambda: True
    _bad_metadata_check()
    hq, hkv, d = 4, 2, 64
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, hq, d, generator=g).to(DEVICE)
    k, v = torch.randn(4, hkv, d, generator=g).to(DEVICE), torch.randn(4, hkv, d, generator=g).to(DEVICE)
    buf = torch.full((6, hq, d), 7.0, device=DEVICE)
    out = buf[1:5]
    for cu in ([0, 200], [-100, 200]):
        P.prefill(q, k, v, torch.tensor(cu, dtype=torch.int32, device=DEVICE), 200, d**-0.5, None, out)
        assert torch.isfinite(out).all()
        assert (buf[0] == 7).all() and (buf[5] == 7).all()


def test_bad_metadata_stays_in_bounds_with_the_mask_split():
    _isolated("_bad_metadata_split_check")
