"""Bad metadata with value checks off (the production default): the ops that take a cache or
lengths read and write nothing outside their tensors and leave no output row uninitialised; with
value checks on, the same calls raise InvalidArgumentError naming the argument.

Each cache is a slice of a larger buffer whose surrounding elements are NaN (sentinels): a
kernel that wraps a negative block id or slot around, or addresses past the cache, reads a NaN
(the output shows it) or writes into the fence (the buffer shows it). Output buffers start as NaN
too, so a row the op never writes shows up.
"""

from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance.checks import GARBAGE, Check, params, suite
from dlinfer.conformance.compare import assert_equal, expect
from dlinfer.conformance.inputs import device, fenced_cache, gen, randn, value_checks
from dlinfer.conformance.suites.bad_inputs import expect_raises
from dlinfer.errors import InvalidArgumentError

NB, BS, HQ, HKV, D = 4, 4, 4, 2, 16
T = 6


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=device())


def _same_with_nans(now, then):
    return torch.equal(now.nan_to_num(0.5), then.nan_to_num(0.5)) and torch.equal(now.isnan(), then.isnan())


# (name, q_ends [B] (cumulative), kv_seq_len [B], block_table [B, M], rows that must be zero,
#  the argument value checks name)
PAGED_CASES = [
    ("ends_stop_short", [2, 4], [3, 2], [[0, 1], [2, 3]], [4, 5], "q_seq_len"),
    ("ends_decrease", [4, 2, 6], [5, 2, 3], [[0, 1], [2, 3], [1, 0]], [], "q_seq_len"),
    ("negative_block_ids", [3, 6], [5, 7], [[-1, -7], [-(2**30), 1]], [], "block_table"),
    ("block_ids_past_cache", [3, 6], [5, 7], [[NB, 2**20], [2**30, 3]], [], "block_table"),
    ("kv_len_past_block_table", [3, 6], [50, 9], [[0, 1], [2, 3]], [], "kv_seq_len"),
    ("kv_len_below_new_tokens", [3, 6], [1, 0], [[0, 1], [2, 3]], [0, 1, 3, 4, 5], "kv_seq_len"),
]
_PAGED = {c[0]: c for c in PAGED_CASES}
PAGED_OPS = ("paged_prefill_attention", "paged_decode_attention")


def _paged_call(op, layout, case, g):
    _, ends, kv, table, _, _ = case
    k_buf, k_cache = fenced_cache(NB, BS, HKV, D, layout, torch.float32, g)
    v_buf, v_cache = fenced_cache(NB, BS, HKV, D, layout, torch.float32, g)
    before = (k_buf.clone(), v_buf.clone())
    q = randn((T, HQ, D), torch.float32, g)
    out = torch.full((T, HQ, D), float("nan"), device=device())
    common = dict(block_table=_i32(table), block_size=BS, q_seq_len=_i32(ends), kv_seq_len=_i32(kv),
                  num_q_heads=HQ, num_kv_heads=HKV, attn_output=out)
    if op == "paged_prefill_attention":
        call = lambda: ops.paged_prefill_attention(q, None, None, k_cache, v_cache, max_q_seq_len=T,  # noqa: E731
                                                   max_kv_seq_len=max(kv), **common)
    else:
        call = lambda: ops.paged_decode_attention(q, k_cache, v_cache, max_kv_seq_len=max(kv), **common)  # noqa: E731
    return call, out, (k_buf, v_buf), before


def _paged(vendor, layout, op, case):
    call, out, bufs, before = _paged_call(op, layout, _PAGED[case], gen(7))
    with value_checks(False):
        call()
    expect(torch.isfinite(out).all(), f"{op}: NaN in the output (a read outside the cache or an unwritten row)")
    for row in _PAGED[case][4]:
        if op == "paged_prefill_attention":  # decode zeroes the same rows only where it sees no key
            expect(torch.equal(out[row], torch.zeros_like(out[row])), f"{op}: row {row} is not zero")
    for now, then in zip(bufs, before):
        expect(_same_with_nans(now, then), f"{op}: a read-only op changed the cache or the memory around it")


@suite("paged_attention_with_bad_metadata")
def paged_attention_with_bad_metadata(layouts):
    return [Check("paged_attention_with_bad_metadata", params(layout, op, c[0]), op, GARBAGE,
                  partial(_paged, layout=layout, op=op, case=c[0]), case=c[0], layout=layout, head_dim=D)
            for layout in layouts for op in PAGED_OPS for c in PAGED_CASES]


def _paged_rejected(vendor, layout, op, case):
    call, *_ = _paged_call(op, layout, _PAGED[case], gen(7))
    with value_checks(True):
        err = expect_raises(InvalidArgumentError, call, f"{op} with {case} (value checks on)")
    arg = _PAGED[case][5]
    expect(f"'{arg}'" in str(err), f"{op} with {case}: the error does not name {arg!r}: {err}")


@suite("paged_attention_bad_metadata_rejected_with_value_checks")
def paged_attention_bad_metadata_rejected_with_value_checks(layouts):
    return [Check("paged_attention_bad_metadata_rejected_with_value_checks", params(layout, op, c[0]), op, GARBAGE,
                  partial(_paged_rejected, layout=layout, op=op, case=c[0]), case=c[0], layout=layout, head_dim=D)
            for layout in layouts for op in PAGED_OPS for c in PAGED_CASES]


PREFILL_ENDS = [("stop_short", [2, 4], [4, 5]), ("decrease", [4, 1, 6], [])]


def _prefill_ends(vendor, ends, zero_rows):
    g = gen(3)
    q, k, v = (randn((T, h, D), torch.float32, g) for h in (HQ, HKV, HKV))
    lens = [ends[0]] + [b - a for a, b in zip(ends[:-1], ends[1:])]
    out = torch.full((T, HQ, D), float("nan"), device=device())
    with value_checks(False):
        ops.prefill_attention(q, k, v, None, None, _i32(lens), _i32(lens), T, HQ, HKV, attn_output=out,
                              actual_seq_lengths_cpu=torch.tensor(ends, dtype=torch.int32))
    expect(torch.isfinite(out).all(), "prefill_attention: NaN in the output (an unwritten row)")
    for row in zero_rows:
        expect(torch.equal(out[row], torch.zeros_like(out[row])), f"prefill_attention: row {row} is not zero")


@suite("prefill_attention_with_bad_cumulative_ends")
def prefill_attention_with_bad_cumulative_ends(layouts):
    return [Check("prefill_attention_with_bad_cumulative_ends", name, "prefill_attention", GARBAGE,
                  partial(_prefill_ends, ends=ends, zero_rows=rows), case=name, head_dim=D)
            for name, ends, rows in PREFILL_ENDS]


# fill_kv_cache: (name, slots [T]); the bad ones are dropped, the good ones written.
FILL_SLOTS = [
    ("negative_slots", [3, -1, 9, -(2**20), 14]),
    ("slots_past_cache", [NB * BS, 3, 2**30, 9, NB * BS + BS]),
    ("int64_slots_past_int32", [2**33, 3, -(2**33), 9, 2**31]),
]
_FILL = dict(FILL_SLOTS)


def _fill_call(layout, slots, g):
    n = len(slots)
    key, value = randn((n, HKV, D), torch.float32, g), randn((n, HKV, D), torch.float32, g)
    k_buf, k_cache = fenced_cache(NB, BS, HKV, D, layout, torch.float32, g)
    v_buf, v_cache = fenced_cache(NB, BS, HKV, D, layout, torch.float32, g)
    idx = torch.tensor(slots, dtype=torch.int64, device=device())
    return key, value, (k_buf, v_buf), (k_cache, v_cache), idx


def _expected_fill(buf, cache, src, slots, layout):
    from dlinfer.conformance.reference import cache_slot_view

    exp = buf.clone()
    inner = exp[1:NB + 1]
    for t, slot in enumerate(slots):
        if 0 <= slot < NB * BS:
            cache_slot_view(inner, slot, BS, layout).copy_(src[t])
    return exp


def _fill(vendor, layout, case):
    slots = _FILL[case]
    key, value, bufs, caches, idx = _fill_call(layout, slots, gen(11))
    expected = [_expected_fill(b.cpu(), c, s.cpu(), slots, layout) for b, c, s in zip(bufs, caches, (key, value))]
    with value_checks(False):
        ops.fill_kv_cache(key, value, caches[0], caches[1], idx, k_scales_zeros=(), v_scales_zeros=(), quant_bits=0)
    for name, buf, exp in zip(("key", "value"), bufs, expected):
        assert_equal(buf.cpu(), exp, "fill_kv_cache", name=f"{name} cache and the NaN fence around it "
                                                            "(bad slots must be dropped)")


@suite("fill_kv_cache_with_bad_slots")
def fill_kv_cache_with_bad_slots(layouts):
    return [Check("fill_kv_cache_with_bad_slots", params(layout, name), "fill_kv_cache", GARBAGE,
                  partial(_fill, layout=layout, case=name), case=name, layout=layout)
            for layout in layouts for name, _ in FILL_SLOTS]


def _fill_rejected(vendor, layout, case):
    key, value, bufs, caches, idx = _fill_call(layout, _FILL[case], gen(11))
    before = [b.clone() for b in bufs]
    with value_checks(True):
        err = expect_raises(InvalidArgumentError, lambda: ops.fill_kv_cache(key, value, caches[0], caches[1], idx),
                            f"fill_kv_cache with {case} (value checks on)")
    expect("'kv_indices'" in str(err), f"fill_kv_cache with {case}: the error does not name 'kv_indices': {err}")
    for buf, then in zip(bufs, before):
        expect(_same_with_nans(buf, then), "fill_kv_cache: a rejected call wrote the cache")


@suite("fill_kv_cache_bad_slots_rejected_with_value_checks")
def fill_kv_cache_bad_slots_rejected_with_value_checks(layouts):
    return [Check("fill_kv_cache_bad_slots_rejected_with_value_checks", params(layout, name), "fill_kv_cache",
                  GARBAGE, partial(_fill_rejected, layout=layout, case=name), case=name, layout=layout)
            for layout in layouts for name, _ in FILL_SLOTS]
