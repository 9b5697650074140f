"""The cpu vendor's C++ prefill attention (csrc/prefill_attention.cpp): parity on shapes that cross
its tiles and chunks, and what bad metadata cannot do to the memory around the tensors.

References are float64, written here (per sequence and head: softmax(q k^T * scale + ALiBi,
causal) v over the K/V the test generated, never read back from the cache); tolerances are the
project's table. The op suites (tests/ops) also run every attention case on this vendor.
"""

import math

import pytest
import torch

import dlinfer.ops as ops
import dlinfer.vendor
from dlinfer.conformance.inputs import value_checks
from dlinfer.conformance.tolerances import tolerance
from dlinfer.vendor import selection
from dlinfer.vendor.kv_layouts import HEAD_MAJOR, TOKEN_MAJOR

pytestmark = pytest.mark.skipif("cpu" not in dlinfer.vendor.available(), reason="cpu vendor cannot load here")


def _slopes(hq):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], dtype=torch.float32)


def _reference(q, k, v, hist, scale, slopes):
    """q [n, Hq, D] (positions hist .. hist+n-1), k / v [hist+n, Hkv, D/Dv] -> float64 [n, Hq, Dv]."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    qpos = torch.arange(hist, hist + n, dtype=torch.float64)[:, None]
    kpos = torch.arange(hist + n, dtype=torch.float64)[None, :]
    if slopes is not None:
        s = s + slopes.double()[:, None, None] * (kpos - qpos)[None]
    s = s.masked_fill((kpos > qpos)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v64)


def _assert_close(out, ref, op):
    atol, rtol = tolerance(op, out.dtype)
    err = (out.double() - ref).abs()
    bound = atol + rtol * ref.abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{op} {out.dtype}: |out - ref| {err.flatten()[worst]:.3g} > "
                                        f"{bound.flatten()[worst]:.3g} at flat index {worst}")


# (new tokens per sequence, Hq, Hkv, D): lengths at and around the tile sizes (96 rows / G tokens,
# halved while a call has few items) and the 64-key chunks; one token; many mixed sequences.
PREFILL_SHAPES = [
    ((1,), 3, 1, 64),
    ((31, 32, 33), 9, 3, 64),
    ((97, 1, 64, 65), 8, 8, 80),
    ((200,), 24, 3, 128),
    ((5, 17, 1, 129, 3, 40, 96, 12), 9, 3, 64),
    ((300, 2), 16, 2, 80),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lens,hq,hkv,d", PREFILL_SHAPES, ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("alibi", [False, True], ids=["causal", "alibi"])
def test_prefill_attention_matches_float64(lens, hq, hkv, d, dtype, alibi):
    g = torch.Generator().manual_seed(hash((lens, hq, d)) % 2**31)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    slopes = _slopes(hq) if alibi else None
    scale = 0.7 / math.sqrt(d)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    with selection.using("cpu"):
        out = ops.prefill_attention(q, k, v, None, None, lens_t, lens_t, max(lens), hq, hkv, [],
                                    softmax_scale=scale, alibi_slopes=slopes)
    start = 0
    for n in lens:
        ref = _reference(q[start:start + n], k[start:start + n], v[start:start + n], 0, scale, slopes)
        _assert_close(out[start:start + n], ref, "prefill_attention")
        start += n


def _cache_pair(nb, bs, hkv, d, dv, layout, dtype, g, garbage=30.0):
    """(fenced buffers, caches): random caches (times `garbage`: far from the live values) inside
    buffers with a NaN block on each side."""
    bufs, caches = [], []
    for width in (d, dv):
        shape = (nb + 2, bs, hkv, width) if layout == TOKEN_MAJOR else (nb + 2, hkv, bs, width)
        buf = torch.full(shape, float("nan"), dtype=dtype)
        buf[1:nb + 1] = (torch.randn(shape[0] - 2, *shape[1:], generator=g) * garbage).to(dtype)
        bufs.append(buf)
        caches.append(buf[1:nb + 1])
    return bufs, caches


def _write(cache, block, offset, rows, layout):
    """rows [Hkv, D] into slot `offset` of `block`."""
    if layout == TOKEN_MAJOR:
        cache[block, offset] = rows
    else:
        cache[block, :, offset] = rows


def _paged_setup(seqs, hq, hkv, d, bs, layout, dtype, g, int8=False, garbage=30.0):
    """seqs: (history, new) per sequence. The sequences' K/V go to shuffled blocks; block-table
    entries past a sequence's last block hold garbage ids."""
    need = [-(-(h + n) // bs) for h, n in seqs]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    cols = max(need) + 2
    table = torch.tensor([[2**30, -5] * cols] * len(seqs), dtype=torch.int32)[:, :cols]
    cache_dtype = torch.int8 if int8 else dtype
    bufs, (kc, vc) = _cache_pair(nb, bs, hkv, d, d, layout, torch.float32, g, garbage)
    if int8:
        bufs = [torch.randint(-128, 128, b.shape, dtype=torch.int8, generator=g) for b in bufs]
        kc, vc = bufs[0][1:nb + 1], bufs[1][1:nb + 1]
    else:
        bufs = [b.to(cache_dtype) for b in bufs]
        kc, vc = bufs[0][1:nb + 1], bufs[1][1:nb + 1]
    ks, vs, qs, used = [], [], [], 0
    for b, (h, n) in enumerate(seqs):
        ids = perm[used:used + need[b]]
        used += need[b]
        table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if int8:
            k = torch.randint(-127, 128, (h + n, hkv, d), dtype=torch.int8, generator=g)
            v = torch.randint(-127, 128, (h + n, hkv, d), dtype=torch.int8, generator=g)
        else:
            k, v = (torch.randn(h + n, hkv, d, generator=g).to(dtype) for _ in range(2))
        for p in range(h + n):
            _write(kc, ids[p // bs], p % bs, k[p], layout)
            _write(vc, ids[p // bs], p % bs, v[p], layout)
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(n, hq, d, generator=g).to(dtype))
    return bufs, kc, vc, table, ks, vs, torch.cat(qs)


# (history, new) per sequence, Hq, Hkv, D, block size
PAGED_SHAPES = [
    (((0, 1),), 3, 1, 64, 16),
    (((0, 33), (5, 31), (63, 2)), 9, 3, 64, 16),
    (((64, 64), (1, 97)), 8, 8, 80, 64),
    (((200, 100),), 24, 3, 128, 64),
    (((7, 9), (100, 3), (15, 17), (1, 1), (250, 40), (0, 65)), 9, 3, 64, 16),
    (((512, 512),), 9, 3, 64, 64),  # LMDeploy's second 512-token chunk of a 1024-token prompt
]


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seqs,hq,hkv,d,bs", PAGED_SHAPES, ids=lambda x: str(x).replace(" ", ""))
def test_paged_prefill_attention_matches_float64(seqs, hq, hkv, d, bs, dtype, layout):
    g = torch.Generator().manual_seed(hash((seqs, hq, d, bs)) % 2**31)
    bufs, kc, vc, table, ks, vs, q = _paged_setup(seqs, hq, hkv, d, bs, layout, dtype, g)
    before = [b.clone() for b in bufs]
    slopes = _slopes(hq) if len(seqs) == 6 else None  # ALiBi on the many-sequence case
    ends = torch.tensor(list(_cumsum([n for _, n in seqs])), dtype=torch.int32)
    kv_lens = torch.tensor([h + n for h, n in seqs], dtype=torch.int32)
    with selection.using("cpu", layout):
        out = ops.paged_prefill_attention(q, None, None, kc, vc, table, bs, ends, kv_lens, max(n for _, n in seqs),
                                          int(kv_lens.max()), hq, hkv, [], alibi_slopes=slopes)
    start = 0
    for (h, n), k, v in zip(seqs, ks, vs):
        ref = _reference(q[start:start + n], k, v, h, d ** -0.5, slopes)
        _assert_close(out[start:start + n], ref, "paged_prefill_attention")
        start += n
    for now, then in zip(bufs, before):  # read only, NaN fences untouched
        assert torch.equal(now.isnan(), then.isnan()) and torch.equal(now.nan_to_num(0), then.nan_to_num(0))


def _cumsum(xs):
    acc = 0
    for x in xs:
        acc += x
        yield acc


def test_paged_prefill_int8_cache_matches_float64():
    """quant_bits=8: the kernel reads int8 in place; reference on the dequantised values."""
    g = torch.Generator().manual_seed(5)
    seqs, hq, hkv, d, bs = ((40, 70), (0, 5), (130, 33)), 9, 3, 64, 16
    bufs, kc, vc, table, ks, vs, q = _paged_setup(seqs, hq, hkv, d, bs, TOKEN_MAJOR, torch.float32, g, int8=True)
    scales = torch.rand(2, hkv, generator=g) * 0.02 + 0.005
    zeros = torch.randn(2, hkv, generator=g) * 3
    ends = torch.tensor(list(_cumsum([n for _, n in seqs])), dtype=torch.int32)
    kv_lens = torch.tensor([h + n for h, n in seqs], dtype=torch.int32)
    with selection.using("cpu", TOKEN_MAJOR):
        out = ops.paged_prefill_attention(q, None, None, kc, vc, table, bs, ends, kv_lens, 70, 163, hq, hkv, [],
                                          kv_scales=scales, kv_zeros=zeros, quant_bits=8)
    start = 0
    for (h, n), k, v in zip(seqs, ks, vs):
        kf = (k.double() - zeros[0].double()[:, None]) * scales[0].double()[:, None]
        vf = (v.double() - zeros[1].double()[:, None]) * scales[1].double()[:, None]
        ref = _reference(q[start:start + n], kf, vf, h, d ** -0.5, None)
        _assert_close(out[start:start + n], ref, "paged_prefill_attention")
        start += n


# Bad metadata (value checks off) on shapes that cross tiles and chunks: (q ends, kv lens, bad
# block-table entries (sequence, column, id)). The output sits in a NaN-fenced buffer and starts
# NaN. The result must be what the torch vendor's code (the same rules: ids clamped, lengths
# clamped to the block table, rows before a sequence's first position and rows no sequence
# covers zero, later sequences owning shared rows) computes in float64 on the same inputs; the
# garbage the clamped ids read is O(1) here, like the live values, so the table's bound holds.
BAD = [
    ("ids_negative_and_past_cache", [100, 180], [300, 80], [(0, 1, -1), (0, 3, 2**30), (1, 0, -(2**20))]),
    ("kv_len_below_new_tokens", [100, 180], [40, 0], []),
    ("kv_len_past_block_table", [100, 180], [10**6, 90], []),
    ("ends_decrease_and_stop_short", [150, 60, 170], [200, 10, 130], []),
]


def _fenced_output(t, hq, d):
    fence = torch.full((t + 4, hq, d), float("nan"))
    return fence, fence[2:t + 2]


def _check_fence(fence, t, what):
    assert fence[:2].isnan().all() and fence[t + 2:].isnan().all(), f"{what}: wrote outside attn_output"
    assert torch.isfinite(fence[2:t + 2]).all(), f"{what}: NaN in the output (a read outside, an unwritten row)"


@pytest.mark.parametrize("name,ends,kv,bad", BAD, ids=[b[0] for b in BAD])
def test_paged_prefill_bad_metadata_stays_inside_and_matches_torch(name, ends, kv, bad):
    from dlinfer.vendor.torch import attention as torch_attention

    g = torch.Generator().manual_seed(11)
    hq, hkv, d, bs, t = 9, 3, 64, 16, 180
    seqs = [(250, 50) for _ in ends]
    bufs, kc, vc, table, _, _, _ = _paged_setup(seqs, hq, hkv, d, bs, TOKEN_MAJOR, torch.float32, g, garbage=1.0)
    before = [b.clone() for b in bufs]
    for b, col, block in bad:
        table[b, col] = block
    q = torch.randn(t, hq, d, generator=g)
    ends_t, kv_t = torch.tensor(ends, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32)
    fence, out = _fenced_output(t, hq, d)
    with selection.using("cpu", TOKEN_MAJOR), value_checks(False):
        ops.paged_prefill_attention(q, None, None, kc, vc, table, bs, ends_t, kv_t, t, max(kv), hq, hkv, [],
                                    attn_output=out)
    _check_fence(fence, t, "cpu vendor")
    ref = torch.full((t, hq, d), float("nan"), dtype=torch.float64)
    torch_attention.paged_prefill_attention(q.double(), kc.double(), vc.double(), table,
                                            torch.cat([torch.zeros(1, dtype=torch.int32), ends_t]), kv_t, t, max(kv),
                                            d ** -0.5, None, ref, TOKEN_MAJOR)
    _assert_close(out, ref, "paged_prefill_attention")
    for now, then in zip(bufs, before):
        assert torch.equal(now.isnan(), then.isnan()) and torch.equal(now.nan_to_num(0), then.nan_to_num(0))


@pytest.mark.parametrize("ends", [[100, 180], [150, 60, 170], [-5, 90, 400]], ids=str)
def test_prefill_bad_ends_stay_inside_and_match_torch(ends):
    from dlinfer.vendor.torch import attention as torch_attention

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, t = 9, 3, 64, 180
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    lens = torch.tensor([ends[0]] + [b - a for a, b in zip(ends[:-1], ends[1:])], dtype=torch.int32)
    ends_t = torch.tensor(ends, dtype=torch.int32)
    fence, out = _fenced_output(t, hq, d)
    with selection.using("cpu"), value_checks(False):
        ops.prefill_attention(q, k, v, None, None, lens, lens, t, hq, hkv, attn_output=out,
                              actual_seq_lengths_cpu=ends_t)
    _check_fence(fence, t, "cpu vendor")
    ref = torch.full((t, hq, d), float("nan"), dtype=torch.float64)
    torch_attention.prefill_attention(q.double(), k.double(), v.double(),
                                      torch.cat([torch.zeros(1, dtype=torch.int32), ends_t]), t, d ** -0.5, None, ref)
    _assert_close(out, ref, "prefill_attention")
