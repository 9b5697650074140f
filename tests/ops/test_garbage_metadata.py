"""Bad metadata with value checks off (the production default): the attention ops read nothing
outside the caches and leave no output row uninitialised, on every vendor and layout; with
value checks on, the same calls raise InvalidArgumentError naming the argument.

Each cache is a slice of a larger buffer whose surrounding elements are NaN (sentinels): a
kernel that wraps a negative block id around, or addresses past the cache, reads a NaN and the
output shows it. The output buffer starts as NaN too, so a row the op never writes shows up.
"""

import pytest
import torch

import dlinfer.ops as ops
from dlinfer.errors import InvalidArgumentError

from .cases import DEVICE, active, gen, randn, vendor_params

NB, BS, HQ, HKV, D = 4, 4, 4, 2, 16
T = 6


def _fenced_cache(layout, g):
    """A [NB, ...] cache inside a buffer with NaN blocks before and after it."""
    block = (BS, HKV, D) if layout == "token_major" else (HKV, BS, D)
    buf = torch.full((NB + 2, *block), float("nan"), device=DEVICE)
    buf[1:NB + 1] = randn((NB, *block), torch.float32, g)
    return buf, buf[1:NB + 1]


@pytest.fixture(autouse=True)
def _value_checks_off():
    ops.set_value_checks(False)
    yield
    ops.set_value_checks(None)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


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


def _paged_call(op, layout, case, g):
    _, ends, kv, table, _, _ = case
    k_buf, k_cache = _fenced_cache(layout, g)
    v_buf, v_cache = _fenced_cache(layout, g)
    before = (k_buf.clone(), v_buf.clone())
    q = randn((T, HQ, D), torch.float32, g)
    out = torch.full((T, HQ, D), float("nan"), device=DEVICE)
    common = dict(block_table=_i32(table), block_size=BS, q_seq_len=_i32(ends), kv_seq_len=_i32(kv),
                  num_q_heads=HQ, num_kv_heads=HKV, attn_output=out)
    if op == "paged_prefill_attention":
        call = lambda: ops.paged_prefill_attention(q, None, None, k_cache, v_cache, max_q_seq_len=T,  # noqa: E731
                                                   max_kv_seq_len=max(kv), **common)
    else:
        call = lambda: ops.paged_decode_attention(q, k_cache, v_cache, max_kv_seq_len=max(kv), **common)  # noqa: E731
    return call, out, (k_buf, v_buf), before


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
@pytest.mark.parametrize("op", ["paged_prefill_attention", "paged_decode_attention"])
@pytest.mark.parametrize("vendor,layout", vendor_params(with_layout=True))
def test_paged_attention_with_bad_metadata(vendor, layout, op, case):
    call, out, bufs, before = _paged_call(op, layout, case, gen(7))
    with active(vendor, layout):
        call()
    assert torch.isfinite(out).all(), f"{op}: NaN in the output (a read outside the cache or an unwritten row)"
    for row in case[4]:
        if op == "paged_prefill_attention":  # decode zeroes the same rows only where it sees no key
            assert torch.equal(out[row], torch.zeros_like(out[row])), f"row {row} is not zero"
    for now, then in zip(bufs, before):
        assert torch.equal(now.nan_to_num(0.5), then.nan_to_num(0.5)), "a read-only op changed the cache"


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
@pytest.mark.parametrize("op", ["paged_prefill_attention", "paged_decode_attention"])
def test_paged_attention_bad_metadata_rejected_with_value_checks(op, case):
    call, *_ = _paged_call(op, "token_major", case, gen(7))
    ops.set_value_checks(True)
    with active("torch", "token_major"), pytest.raises(InvalidArgumentError, match=f"'{case[5]}'"):
        call()


PREFILL_ENDS = [("stop_short", [2, 4], [4, 5]), ("decrease", [4, 1, 6], [])]


@pytest.mark.parametrize("ends,zero_rows", [c[1:] for c in PREFILL_ENDS], ids=[c[0] for c in PREFILL_ENDS])
@pytest.mark.parametrize("vendor", vendor_params())
def test_prefill_attention_with_bad_cumulative_ends(vendor, ends, zero_rows):
    g = gen(3)
    q, k, v = (randn((T, h, D), torch.float32, g) for h in (HQ, HKV, HKV))
    lens = [ends[0]] + [b - a for a, b in zip(ends[:-1], ends[1:])]
    out = torch.full((T, HQ, D), float("nan"), device=DEVICE)
    with active(vendor):
        ops.prefill_attention(q, k, v, None, None, _i32(lens), _i32(lens), T, HQ, HKV, attn_output=out,
                              actual_seq_lengths_cpu=torch.tensor(ends, dtype=torch.int32))
    assert torch.isfinite(out).all()
    for row in zero_rows:
        assert torch.equal(out[row], torch.zeros_like(out[row]))
