"""prefill_attention, paged_prefill_attention and paged_decode_attention parity.

Caches hold finite garbage (or NaN, in the stale-slot checks) everywhere but the live tokens,
which the check writes itself (not through fill_kv_cache); block tables are shuffled, with garbage
past each sequence's last block.
"""

from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import PARITY, Check, params, suite
from dlinfer.conformance.compare import assert_close, assert_equal, expect
from dlinfer.conformance.inputs import (
    DTYPES,
    alloc_cache,
    device,
    gen,
    lens_tensor,
    make_block_table,
    memo,
    packed_qkv,
    randn,
    seed_of,
    slots_of,
    write_cache,
)
from dlinfer.conformance.suites.attention_cases import DECODE_CASES, PAGED_PREFILL_CASES, PREFILL_CASES

I32, I64 = torch.int32, torch.int64


def _ids(cases):
    return {c.id: c for c in cases}


# ---------------------------------------------------------------- helpers


def _slopes(case):
    return ref.alibi_slopes(case.hq).to(device()) if case.alibi else None


def _output_buffer(case, q, mode):
    """None, a fresh tensor, or LMDeploy's strided query[..., :Dv] view."""
    if mode == "none":
        return None
    if mode == "fresh":
        return torch.empty(q.shape[0], case.hq, case.dv, dtype=q.dtype, device=q.device)
    return q[..., : case.dv]


def _check_output(out, attn_output, case, dtype, expected, op):
    expect(isinstance(out, torch.Tensor) and tuple(out.shape) == (case.T, case.hq, case.dv),
           f"{op}: returned {getattr(out, 'shape', out)}, expected shape {(case.T, case.hq, case.dv)}")
    expect(out.dtype == dtype and out.device.type == device().type, f"{op}: output {out.dtype} on {out.device}")
    if attn_output is not None:
        expect(out.data_ptr() == attn_output.data_ptr() and out.stride() == attn_output.stride(),
               f"{op} must write attn_output and return it")
        assert_close(attn_output, expected, op, name="attn_output")
    assert_close(out, expected, op)


class PagedSetup:
    """Caches, block table, lengths and the new tokens of one paged case (caches already hold them)."""

    def __init__(self, case, dtype, layout, seed, stale=None):
        g = gen(seed)
        self.case = case
        T = case.T
        self.q, self.k, self.v = packed_qkv(T, case.hq, case.hkv, case.d, case.dv, dtype, g, case.packed)
        self.paged = make_block_table(case.kv_lens, case.bs, g, case.index_dtype)
        nb = self.paged.num_blocks
        fill = g if stale is None else stale
        self.key_cache = alloc_cache(nb, case.bs, case.hkv, case.d, layout, dtype, fill)
        self.value_cache = alloc_cache(nb, case.bs, case.hkv, case.dv, layout, dtype, fill)
        if stale is None:  # finite garbage, far from the live values
            self.key_cache.mul_(30)
            self.value_cache.mul_(30)
        if case.latent:  # MLA: the value is the key's first Dv dims, read through a view of the key cache
            self.value_cache = self.key_cache[..., :case.dv]
            self.v = self.k[..., :case.dv]
        start = 0
        for b, (hist, n) in enumerate(case.seqs):
            hk = randn((hist, case.hkv, case.d), dtype, g)
            hv = hk[..., :case.dv] if case.latent else randn((hist, case.hkv, case.dv), dtype, g)
            write_cache(self.key_cache, slots_of(self.paged, b, range(hist), case.bs), hk, case.bs, layout)
            write_cache(self.value_cache, slots_of(self.paged, b, range(hist), case.bs), hv, case.bs, layout)
            new = slots_of(self.paged, b, range(hist, hist + n), case.bs)
            write_cache(self.key_cache, new, self.k[start:start + n], case.bs, layout)
            write_cache(self.value_cache, new, self.v[start:start + n], case.bs, layout)
            start += n
        lens_dtype = I64 if case.index_dtype == I32 else I32  # mix the index dtypes
        self.q_cu_ends = lens_tensor(case.cu_ends, lens_dtype, case.lens_on_cpu)
        self.kv_seq_len = lens_tensor(case.kv_lens, lens_dtype, case.lens_on_cpu)
        self.max_q = max(case.q_lens, default=0)
        self.max_kv = max(case.kv_lens, default=0)
        # live K/V do not depend on the layout (the seed does not): one reference for both layouts
        self.expected = memo((seed, stale is None), lambda: ref.paged_attention(
            self.q, self.key_cache, self.value_cache, self.paged.block_table, case.bs, self.q_cu_ends,
            self.kv_seq_len, layout, case.scale, _slopes(case), case.window, case.softcap))
        self.cache_before = (self.key_cache.clone(), self.value_cache.clone())

    def check_caches_untouched(self, op):
        assert_equal(self.key_cache, self.cache_before[0], op, name="key_cache (read only)")
        assert_equal(self.value_cache, self.cache_before[1], op, name="value_cache (read only)")


def _paged_prefill(vendor, layout, case, dtype, out_mode, stale=None):
    s = PagedSetup(case, dtype, layout, seed_of("pprefill", case.id, dtype), stale)
    attn_output = _output_buffer(case, s.q, out_mode)
    # the call of lmdeploy/pytorch/kernels/dlinfer/pagedattention.py
    out = ops.paged_prefill_attention(
        s.q, s.k, s.v, s.key_cache, s.value_cache, s.paged.block_table, case.bs, s.q_cu_ends,
        s.kv_seq_len, s.max_q, s.max_kv, case.hq, case.hkv, [], head_size_v=case.dv,
        softmax_scale=case.scale, alibi_slopes=_slopes(case), attn_output=attn_output, kv_scales=None,
        kv_zeros=None, quant_bits=0, **case.score_options)
    _check_output(out, attn_output, case, dtype, s.expected, "paged_prefill_attention")
    s.check_caches_untouched("paged_prefill_attention")


def _paged_decode(vendor, layout, case, dtype, out_mode, stale=None):
    s = PagedSetup(case, dtype, layout, seed_of("decode", case.id, dtype), stale)
    attn_output = _output_buffer(case, s.q, out_mode)
    out = ops.paged_decode_attention(
        s.q, s.key_cache, s.value_cache, s.paged.block_table, case.bs, s.q_cu_ends, s.kv_seq_len,
        s.max_kv, case.hq, case.hkv, head_size_v=case.dv, softmax_scale=case.scale,
        alibi_slopes=_slopes(case), attn_output=attn_output, kv_scales=None, kv_zeros=None,
        quant_bits=0, **case.score_options)
    _check_output(out, attn_output, case, dtype, s.expected, "paged_decode_attention")
    s.check_caches_untouched("paged_decode_attention")


# Every case runs with an output mode; LMDeploy's query[..., :Dv] view on half of them.
def _out_mode(case):
    return "query_view" if case.packed else ("fresh" if case.small else "none")


def _attn_check(name, op, fn, layout, case, dtype, extra=None, **kwargs):
    return Check(name, params(layout, case.id, dtype, extra), op, PARITY,
                 partial(fn, layout=layout, case=case, dtype=dtype, **kwargs), case=case.id,
                 dtype=dtype, layout=layout, head_dim=case.d, feature=case.features,
                 small=case.small)


# ---------------------------------------------------------------- prefill_attention


def _prefill(vendor, layout, case, dtype, with_cpu_ends):
    seed = seed_of("prefill", case.id, dtype)
    g = gen(seed)
    q, k, v = packed_qkv(case.T, case.hq, case.hkv, case.d, case.dv, dtype, g, case.packed)
    if case.latent:  # MLA: the value is a view of the key's first Dv dims
        v = k[..., :case.dv]
    expected = memo(seed, lambda: ref.prefill_attention(q, k, v, torch.tensor(case.q_lens), case.scale,
                                                        _slopes(case), case.window, case.softcap))
    # LMDeploy passes the (filled) caches; the op must not need nor touch them.
    kc = alloc_cache(3, case.bs, case.hkv, case.d, layout, dtype, g)
    vc = alloc_cache(3, case.bs, case.hkv, case.dv, layout, dtype, g)
    before = (kc.clone(), vc.clone())
    q_lens = lens_tensor(case.q_lens, case.index_dtype, case.lens_on_cpu)
    kv_lens = lens_tensor(case.q_lens, case.index_dtype, case.lens_on_cpu)
    cpu_ends = torch.tensor(case.cu_ends, dtype=I32) if with_cpu_ends else None
    attn_output = _output_buffer(case, q, _out_mode(case))
    out = ops.prefill_attention(q, k, v, kc, vc, q_lens, kv_lens, max(case.q_lens), case.hq, case.hkv, [],
                                softmax_scale=case.scale, alibi_slopes=_slopes(case), attn_output=attn_output,
                                actual_seq_lengths_cpu=cpu_ends, **case.score_options)
    _check_output(out, attn_output, case, dtype, expected, "prefill_attention")
    assert_equal(kc, before[0], "prefill_attention", name="key_cache (unused)")
    assert_equal(vc, before[1], "prefill_attention", name="value_cache (unused)")


@suite("prefill_attention")
def prefill_attention(layouts):
    return [_attn_check("prefill_attention", "prefill_attention", _prefill, layout, c, dt,
                        "cpu_ends" if ends else "no_cpu_ends", with_cpu_ends=ends)
            for layout in layouts for c in PREFILL_CASES for dt in DTYPES for ends in (True, False)]


def _prefill_no_caches(vendor, dtype):
    case = _ids(PREFILL_CASES)["b3_gqa4_d80"]
    g = gen(seed_of("prefill_none", dtype))
    q, k, v = packed_qkv(case.T, case.hq, case.hkv, case.d, case.dv, dtype, g, True)
    expected = ref.prefill_attention(q, k, v, torch.tensor(case.q_lens))
    lens = torch.tensor(case.q_lens, dtype=I32, device=device())
    out = ops.prefill_attention(q, k, v, None, None, lens, lens, max(case.q_lens), case.hq, case.hkv, [])
    _check_output(out, None, case, dtype, expected, "prefill_attention")


@suite("prefill_attention_no_caches")
def prefill_attention_no_caches(layouts):
    case = _ids(PREFILL_CASES)["b3_gqa4_d80"]
    return [Check("prefill_attention_no_caches", params(dt), "prefill_attention", PARITY,
                  partial(_prefill_no_caches, dtype=dt), case="no_caches", dtype=dt, head_dim=case.d) for dt in DTYPES]


# ---------------------------------------------------------------- paged ops


@suite("paged_prefill_attention")
def paged_prefill_attention(layouts):
    return [_attn_check("paged_prefill_attention", "paged_prefill_attention", _paged_prefill, layout, c, dt,
                        out_mode=_out_mode(c))
            for layout in layouts for c in PAGED_PREFILL_CASES for dt in DTYPES]


@suite("paged_decode_attention")
def paged_decode_attention(layouts):
    return [_attn_check("paged_decode_attention", "paged_decode_attention", _paged_decode, layout, c, dt,
                        out_mode=_out_mode(c))
            for layout in layouts for c in DECODE_CASES for dt in DTYPES]


STALE_CASES = [_ids(PAGED_PREFILL_CASES)["b3_gqa4_d80_bs8"], _ids(DECODE_CASES)["b3_gqa4_d80_bs8"]]


def _nan_in_unused_slots(vendor, layout, op):
    """Slots past kv_seq_len (inside the last block, and in unused blocks) may hold anything,
    NaN included (a cache from torch.empty): they must not reach the output."""
    if op == "paged_prefill_attention":
        _paged_prefill(vendor, layout, STALE_CASES[0], torch.float16, "none", stale=float("nan"))
    else:
        _paged_decode(vendor, layout, STALE_CASES[1], torch.float16, "none", stale=float("nan"))


@suite("paged_attention_nan_in_unused_slots")
def paged_attention_nan_in_unused_slots(layouts):
    return [Check("paged_attention_nan_in_unused_slots", params(layout, op, "float16"), op, PARITY,
                  partial(_nan_in_unused_slots, layout=layout, op=op), case="nan_in_unused_slots",
                  dtype=torch.float16, layout=layout, head_dim=80)
            for layout in layouts for op in ("paged_prefill_attention", "paged_decode_attention")]


def _empty_batch(vendor, layout, op):
    """B = 0, T = 0: an empty [0, Hq, Dv] result."""
    dtype, hq, hkv, d, bs = torch.float32, 4, 2, 64, 16
    q = torch.empty(0, hq, d, dtype=dtype, device=device())
    k = torch.empty(0, hkv, d, dtype=dtype, device=device())
    kc = alloc_cache(2, bs, hkv, d, layout, dtype, gen(0))
    vc = alloc_cache(2, bs, hkv, d, layout, dtype, gen(1))
    empty = torch.empty(0, dtype=I32)
    bt = torch.empty(0, 3, dtype=I32, device=device())
    if op == "prefill_attention":
        out = ops.prefill_attention(q, k, k, kc, vc, empty, empty, 0, hq, hkv, [], actual_seq_lengths_cpu=empty)
    elif op == "paged_prefill_attention":
        out = ops.paged_prefill_attention(q, k, k, kc, vc, bt, bs, empty, empty, 0, 0, hq, hkv, [])
    else:
        out = ops.paged_decode_attention(q, kc, vc, bt, bs, empty, empty, 0, hq, hkv)
    expect(tuple(out.shape) == (0, hq, d) and out.dtype == dtype, f"{op}: empty batch gave {out.shape} {out.dtype}")


@suite("attention_empty_batch")
def attention_empty_batch(layouts):
    return [Check("attention_empty_batch", params(layout, op), op, PARITY, partial(_empty_batch, layout=layout, op=op),
                  case="empty_batch", layout=layout, head_dim=64)
            for op in ("paged_prefill_attention", "paged_decode_attention", "prefill_attention") for layout in layouts]


def _lmdeploy_layer_steps(vendor, layout):
    """LMDeploy's per-layer sequence through dlinfer.ops: fill_kv_cache, then attention on the
    caches fill_kv_cache returned, writing query[..., :Dv]; a no-cache prefill, a decode step,
    then a prefix-cache hit (paged prefill)."""
    dtype, hq, hkv, d, bs = torch.float32, 8, 2, 64, 4
    g = gen(seed_of("steps", layout))
    seqs = [5, 3]
    paged = make_block_table([12, 12], bs, g, I32)
    kc = alloc_cache(paged.num_blocks, bs, hkv, d, layout, dtype, g)
    vc = alloc_cache(paged.num_blocks, bs, hkv, d, layout, dtype, g)
    history_k = [[], []]
    history_v = [[], []]

    def step(new_lens, kind):
        nonlocal kc, vc
        T = sum(new_lens)
        q, k, v = packed_qkv(T, hq, hkv, d, d, dtype, g, True)
        q_ref = q.clone()
        kv_lens = [len(history_k[b]) + n for b, n in enumerate(new_lens)]
        slots, start = [], 0
        for b, n in enumerate(new_lens):
            slots += slots_of(paged, b, range(kv_lens[b] - n, kv_lens[b]), bs)
            history_k[b] += list(k[start:start + n].cpu())
            history_v[b] += list(v[start:start + n].cpu())
            start += n
        cu = torch.tensor(new_lens).cumsum(0).to(I32)
        kc, vc = ops.fill_kv_cache(k, v, kc, vc, torch.tensor(slots, dtype=I32, device=device()),
                                   k_scales_zeros=[], v_scales_zeros=[], quant_bits=0)
        attn_output = q[..., :d]
        lens_dev = torch.tensor(new_lens, dtype=I32, device=device())
        kv_cpu = torch.tensor(kv_lens, dtype=I32)
        if kind == "prefill":
            out = ops.prefill_attention(q, k, v, kc, vc, lens_dev, lens_dev, max(new_lens), hq, hkv, [],
                                        softmax_scale=None, attn_output=attn_output, actual_seq_lengths_cpu=cu)
        elif kind == "paged_prefill":
            out = ops.paged_prefill_attention(q, k, v, kc, vc, paged.block_table, bs, cu, kv_cpu,
                                              max(new_lens), max(kv_lens), hq, hkv, [], head_size_v=d,
                                              softmax_scale=None, attn_output=attn_output, kv_scales=None,
                                              kv_zeros=None, quant_bits=0)
        else:
            out = ops.paged_decode_attention(q, kc, vc, paged.block_table, bs, cu, kv_cpu, max(kv_lens), hq,
                                             hkv, head_size_v=d, softmax_scale=None, attn_output=attn_output,
                                             kv_scales=None, kv_zeros=None, quant_bits=0)
        expected = torch.zeros(T, hq, d, dtype=torch.float64)
        start = 0
        for b, n in enumerate(new_lens):
            L = kv_lens[b]
            expected[start:start + n] = ref.attention_one_sequence(
                q_ref[start:start + n], torch.stack(history_k[b]), torch.stack(history_v[b]), list(range(L - n, L)))
            start += n
        op = {"prefill": "prefill_attention", "paged_prefill": "paged_prefill_attention",
              "decode": "paged_decode_attention"}[kind]
        assert_close(out, expected, op, name=f"{kind} step output (caches from fill_kv_cache)")

    step(seqs, "prefill")
    step([1, 1], "decode")
    step([3, 2], "paged_prefill")
    step([1, 1], "decode")


LAYER_OP = "fill_kv_cache+attention"  # the summary row of the multi-op check


@suite("lmdeploy_layer_steps")
def lmdeploy_layer_steps(layouts):
    return [Check("lmdeploy_layer_steps", layout, LAYER_OP, PARITY, partial(_lmdeploy_layer_steps, layout=layout),
                  case="layer_steps", layout=layout, head_dim=64,
                  uses=("fill_kv_cache", "prefill_attention", "paged_prefill_attention", "paged_decode_attention"))
            for layout in layouts]
