"""Rejected calls: wrong rank / size / dtype / device ("meta" as the wrong device), bad values
(value checks on) and features a vendor lacks.

Each bad call must raise InvalidArgumentError (a ValueError) whose message names the op and the
argument, before anything is written: caches are compared with their clones afterwards. Every
mutation below breaks exactly one argument against all the others, so the blame is unambiguous.
"""

import re
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance.checks import BAD_INPUT, Check, Skipped, params, suite
from dlinfer.conformance.compare import CheckFailed, assert_equal, expect
from dlinfer.conformance.inputs import alloc_cache, device, gen, value_checks
from dlinfer.conformance.suites import bad_inputs_w8a8
from dlinfer.errors import InvalidArgumentError, UnsupportedError
from dlinfer.vendor.base import FEATURE_KV_QUANT

F32, F16, I32, I64 = torch.float32, torch.float16, torch.int32, torch.int64
META = torch.device("meta")
T, HQ, HKV, D, DV, BS, NB, B = 5, 4, 2, 64, 64, 8, 6, 2
CACHE_OPS = ("fill_kv_cache", "paged_prefill_attention", "paged_decode_attention", "prefill_attention")


def _r(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=gen(seed)).to(dtype=dtype, device=device())


def _i8(*shape, seed=0):
    return torch.randint(-128, 128, shape, generator=gen(seed), dtype=I64).to(dtype=torch.int8, device=device())


def _caches(layout, dv=DV):
    g = gen(1)
    return alloc_cache(NB, BS, HKV, D, layout, F32, g), alloc_cache(NB, BS, HKV, dv, layout, F32, g)


def good_call(op, layout):
    """Keyword arguments (the contract's names) of a valid small fp32 call."""
    if op == "rms_norm":
        return dict(hidden_states=_r(T, 64), weight=_r(64), epsilon=1e-6)
    if op == "add_rms_norm":
        return dict(hidden_states=_r(T, 64), residual=_r(T, 64, seed=1), weight=_r(64), epsilon=1e-6)
    if op == "apply_rotary_pos_emb":
        return dict(query=_r(T, HQ, D), key=_r(T, HKV, D), cos=_r(T, D), sin=_r(T, D))
    if op == "silu_and_mul":
        return dict(input_tensor=_r(T, 128))
    if op == "linear":
        return dict(x=_r(T, 64), weight=_r(48, 64), bias=_r(48))
    if op == "moe_gating_topk_softmax":
        return dict(router_logits=_r(T, 8), topk=2, moe_metadata=None)
    if op == "fused_moe":
        ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], dtype=I64, device=device())
        return dict(hidden_states=_r(T, 32), gate_up_weights=_r(4, 2 * 48, 32), down_weights=_r(4, 32, 48),
                    topk_weights=torch.full((T, 2), 0.5, device=device()), topk_ids=ids, topk=2, renormalize=False,
                    moe_metadata=None, chunked_moe_layout=None)
    w8a8 = bad_inputs_w8a8.good_call(op)
    if w8a8 is not None:
        return w8a8
    kc, vc = _caches(layout)
    if op == "fill_kv_cache":
        return dict(key=_r(T, HKV, D), value=_r(T, HKV, DV), key_cache=kc, value_cache=vc,
                    kv_indices=torch.tensor([3, 4, 17, 40, 9], dtype=I32, device=device()),
                    k_scales_zeros=[], v_scales_zeros=[], quant_bits=0)
    bt = torch.tensor([[2, 0, -1], [5, 2**30, 7]], dtype=I32, device=device())  # garbage past the used blocks
    if op == "prefill_attention":
        return dict(query=_r(T, HQ, D), key=_r(T, HKV, D), value=_r(T, HKV, DV), key_cache=kc, value_cache=vc,
                    q_seq_len=torch.tensor([3, 2], dtype=I32, device=device()),
                    kv_seq_len=torch.tensor([3, 2], dtype=I32, device=device()), max_q_seq_len=3,
                    num_q_heads=HQ, num_kv_heads=HKV, attn_mask=[], softmax_scale=None, alibi_slopes=None,
                    attn_output=None, actual_seq_lengths_cpu=torch.tensor([3, 5], dtype=I32))
    if op == "paged_prefill_attention":  # seq 0: 9 cached (3 new), seq 1: 2 cached (2 new)
        return dict(query=_r(T, HQ, D), key=_r(T, HKV, D), value=_r(T, HKV, DV), key_cache=kc, value_cache=vc,
                    block_table=bt, block_size=BS, q_seq_len=torch.tensor([3, 5], dtype=I32),
                    kv_seq_len=torch.tensor([9, 2], dtype=I32), max_q_seq_len=3, max_kv_seq_len=9,
                    num_q_heads=HQ, num_kv_heads=HKV, attn_mask=[], head_size_v=DV, softmax_scale=None,
                    alibi_slopes=None, attn_output=None, kv_scales=None, kv_zeros=None, quant_bits=0)
    if op == "paged_decode_attention":
        return dict(query=_r(B, HQ, D), key_cache=kc, value_cache=vc, block_table=bt, block_size=BS,
                    q_seq_len=torch.tensor([1, 2], dtype=I32), kv_seq_len=torch.tensor([9, 2], dtype=I32),
                    max_kv_seq_len=9, num_q_heads=HQ, num_kv_heads=HKV, head_size_v=DV, softmax_scale=None,
                    alibi_slopes=None, attn_output=None, kv_scales=None, kv_zeros=None, quant_bits=0)
    raise KeyError(op)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device=META)


def _cache_shape(layout, heads=HKV, dim=D, nb=NB, bs=BS):
    return (nb, bs, heads, dim) if layout == "token_major" else (nb, heads, bs, dim)


def _cache(layout, **kw):
    return torch.zeros(_cache_shape(layout, **kw), device=device())


# (op, argument, what, new value: fn(good kwargs, layout) -> value)
BAD = [
    # rms_norm / add_rms_norm
    ("rms_norm", "hidden_states", "dtype", lambda a, l: a["hidden_states"].to(I32)),
    ("rms_norm", "weight", "size", lambda a, l: _r(63)),
    ("rms_norm", "weight", "rank", lambda a, l: _r(1, 64)),
    ("rms_norm", "weight", "dtype", lambda a, l: a["weight"].to(I32)),
    ("rms_norm", "weight", "device", lambda a, l: _meta(a["weight"])),
    ("add_rms_norm", "residual", "size", lambda a, l: _r(T, 63)),
    ("add_rms_norm", "residual", "tokens", lambda a, l: _r(T + 1, 64)),
    ("add_rms_norm", "residual", "dtype", lambda a, l: a["residual"].to(I32)),
    ("add_rms_norm", "residual", "device", lambda a, l: _meta(a["residual"])),
    ("add_rms_norm", "weight", "size", lambda a, l: _r(65)),
    ("add_rms_norm", "weight", "device", lambda a, l: _meta(a["weight"])),
    # apply_rotary_pos_emb
    ("apply_rotary_pos_emb", "query", "rank", lambda a, l: _r(T, HQ * D)),
    ("apply_rotary_pos_emb", "query", "dtype", lambda a, l: a["query"].to(I32)),
    ("apply_rotary_pos_emb", "key", "tokens", lambda a, l: _r(T + 1, HKV, D)),
    ("apply_rotary_pos_emb", "key", "head_dim", lambda a, l: _r(T, HKV, D + 2)),
    ("apply_rotary_pos_emb", "key", "dtype", lambda a, l: a["key"].to(F16)),
    ("apply_rotary_pos_emb", "key", "device", lambda a, l: _meta(a["key"])),
    ("apply_rotary_pos_emb", "cos", "rotary_dim_gt_D", lambda a, l: _r(T, D + 2)),
    ("apply_rotary_pos_emb", "cos", "tokens", lambda a, l: _r(T + 1, D)),
    ("apply_rotary_pos_emb", "cos", "dtype", lambda a, l: a["cos"].to(I32)),
    ("apply_rotary_pos_emb", "cos", "device", lambda a, l: _meta(a["cos"])),
    ("apply_rotary_pos_emb", "sin", "size", lambda a, l: _r(T, D - 2)),
    ("apply_rotary_pos_emb", "sin", "device", lambda a, l: _meta(a["sin"])),
    # silu_and_mul / linear
    ("silu_and_mul", "input_tensor", "odd", lambda a, l: _r(T, 127)),
    ("silu_and_mul", "input_tensor", "dtype", lambda a, l: a["input_tensor"].to(I32)),
    ("linear", "weight", "size", lambda a, l: _r(48, 63)),
    ("linear", "weight", "rank", lambda a, l: _r(64)),
    ("linear", "weight", "dtype", lambda a, l: a["weight"].to(F16)),
    ("linear", "weight", "device", lambda a, l: _meta(a["weight"])),
    ("linear", "bias", "size", lambda a, l: _r(47)),
    ("linear", "bias", "dtype", lambda a, l: a["bias"].to(F16)),
    ("linear", "bias", "device", lambda a, l: _meta(a["bias"])),
    # moe
    ("moe_gating_topk_softmax", "router_logits", "rank", lambda a, l: _r(8)),
    ("moe_gating_topk_softmax", "router_logits", "dtype", lambda a, l: a["router_logits"].to(I32)),
    ("moe_gating_topk_softmax", "topk", "gt_E", lambda a, l: 9),
    ("moe_gating_topk_softmax", "topk", "zero", lambda a, l: 0),
    ("fused_moe", "hidden_states", "rank", lambda a, l: _r(32)),
    ("fused_moe", "gate_up_weights", "hidden", lambda a, l: _r(4, 96, 31)),
    ("fused_moe", "gate_up_weights", "odd_rows", lambda a, l: _r(4, 95, 32)),
    ("fused_moe", "gate_up_weights", "dtype", lambda a, l: a["gate_up_weights"].to(F16)),
    ("fused_moe", "gate_up_weights", "device", lambda a, l: _meta(a["gate_up_weights"])),
    ("fused_moe", "down_weights", "inter", lambda a, l: _r(4, 32, 47)),
    ("fused_moe", "down_weights", "experts", lambda a, l: _r(3, 32, 48)),
    ("fused_moe", "down_weights", "device", lambda a, l: _meta(a["down_weights"])),
    ("fused_moe", "topk_weights", "tokens", lambda a, l: torch.full((T + 1, 2), 0.5, device=device())),
    ("fused_moe", "topk_weights", "device", lambda a, l: _meta(a["topk_weights"])),
    ("fused_moe", "topk_ids", "k", lambda a, l: a["topk_ids"][:, :1].contiguous()),
    ("fused_moe", "topk_ids", "dtype", lambda a, l: a["topk_ids"].to(F32)),
    ("fused_moe", "topk_ids", "device", lambda a, l: _meta(a["topk_ids"])),
    ("fused_moe", "topk", "mismatch", lambda a, l: 3),
    # fill_kv_cache
    ("fill_kv_cache", "key", "rank", lambda a, l: _r(T, HKV * D)),
    ("fill_kv_cache", "key", "dtype", lambda a, l: a["key"].to(I32)),
    ("fill_kv_cache", "value", "tokens", lambda a, l: _r(T + 1, HKV, DV)),
    ("fill_kv_cache", "value", "dtype", lambda a, l: a["value"].to(F16)),
    ("fill_kv_cache", "value", "device", lambda a, l: _meta(a["value"])),
    ("fill_kv_cache", "kv_indices", "size", lambda a, l: torch.arange(T + 1, dtype=I32, device=device())),
    ("fill_kv_cache", "kv_indices", "Tx2", lambda a, l: torch.arange(2 * T, dtype=I32, device=device()).view(T, 2)),
    ("fill_kv_cache", "kv_indices", "dtype", lambda a, l: a["kv_indices"].to(F32)),
    ("fill_kv_cache", "kv_indices", "device", lambda a, l: _meta(a["kv_indices"])),
    ("fill_kv_cache", "key_cache", "heads", lambda a, l: _cache(l, heads=HKV + 1)),
    ("fill_kv_cache", "key_cache", "head_dim", lambda a, l: _cache(l, dim=D + 16)),
    ("fill_kv_cache", "key_cache", "rank", lambda a, l: torch.zeros(NB * BS, HKV, D, device=device())),
    ("fill_kv_cache", "key_cache", "dtype", lambda a, l: _cache(l).to(F16)),
    ("fill_kv_cache", "key_cache", "device", lambda a, l: _meta(a["key_cache"])),
    ("fill_kv_cache", "value_cache", "head_dim", lambda a, l: _cache(l, dim=DV + 16)),
    ("fill_kv_cache", "value_cache", "blocks", lambda a, l: _cache(l, nb=NB + 1)),
    ("fill_kv_cache", "value_cache", "dtype", lambda a, l: _cache(l).to(F16)),
    ("fill_kv_cache", "value_cache", "device", lambda a, l: _meta(a["value_cache"])),
    # prefill_attention
    ("prefill_attention", "query", "rank", lambda a, l: _r(T, HQ * D)),
    ("prefill_attention", "query", "dtype", lambda a, l: a["query"].to(I32)),
    ("prefill_attention", "key", "heads", lambda a, l: _r(T, HKV + 1, D)),
    ("prefill_attention", "key", "dtype", lambda a, l: a["key"].to(F16)),
    ("prefill_attention", "key", "device", lambda a, l: _meta(a["key"])),
    ("prefill_attention", "value", "tokens", lambda a, l: _r(T + 1, HKV, DV)),
    ("prefill_attention", "value", "device", lambda a, l: _meta(a["value"])),
    ("prefill_attention", "q_seq_len", "dtype", lambda a, l: a["q_seq_len"].to(F32)),
    ("prefill_attention", "q_seq_len", "rank", lambda a, l: a["q_seq_len"].view(1, B)),
    ("prefill_attention", "q_seq_len", "device", lambda a, l: _meta(a["q_seq_len"])),
    ("prefill_attention", "kv_seq_len", "size", lambda a, l: torch.tensor([3, 2, 0], dtype=I32, device=device())),
    ("prefill_attention", "num_q_heads", "mismatch", lambda a, l: HQ + 1),
    ("prefill_attention", "num_kv_heads", "not_divisor", lambda a, l: 3),
    ("prefill_attention", "alibi_slopes", "size", lambda a, l: torch.ones(HQ + 1, device=device())),
    ("prefill_attention", "alibi_slopes", "dtype", lambda a, l: torch.ones(HQ, dtype=F16, device=device())),
    ("prefill_attention", "alibi_slopes", "device", lambda a, l: torch.ones(HQ, device=META)),
    ("prefill_attention", "attn_output", "size", lambda a, l: _r(T, HQ, DV + 1)),
    ("prefill_attention", "attn_output", "dtype", lambda a, l: _r(T, HQ, DV).to(F16)),
    ("prefill_attention", "attn_output", "device", lambda a, l: torch.empty(T, HQ, DV, device=META)),
    ("prefill_attention", "actual_seq_lengths_cpu", "size", lambda a, l: torch.tensor([3, 5, 5], dtype=I32)),
    ("prefill_attention", "actual_seq_lengths_cpu", "dtype", lambda a, l: torch.tensor([3.0, 5.0])),
    *bad_inputs_w8a8.BAD,
]

for _op in ("paged_prefill_attention", "paged_decode_attention"):
    _t = T if _op == "paged_prefill_attention" else B
    BAD += [
        (_op, "query", "rank", lambda a, l: a["query"].flatten(1)),
        (_op, "query", "dtype", lambda a, l: a["query"].to(I32)),
        (_op, "key_cache", "head_dim", lambda a, l: _cache(l, dim=D + 16)),
        (_op, "key_cache", "heads", lambda a, l: _cache(l, heads=HKV + 1)),
        (_op, "key_cache", "dtype", lambda a, l: _cache(l).to(F16)),
        (_op, "key_cache", "device", lambda a, l: _meta(a["key_cache"])),
        (_op, "value_cache", "heads", lambda a, l: _cache(l, heads=HKV + 1, dim=DV)),
        (_op, "value_cache", "head_size_v", lambda a, l: _cache(l, dim=DV + 16)),
        (_op, "value_cache", "block_size", lambda a, l: _cache(l, bs=BS * 2, dim=DV)),
        (_op, "value_cache", "device", lambda a, l: _meta(a["value_cache"])),
        (_op, "block_table", "rank", lambda a, l: a["block_table"][0]),
        (_op, "block_table", "dtype", lambda a, l: a["block_table"].to(F32)),
        (_op, "block_table", "device", lambda a, l: _meta(a["block_table"])),
        (_op, "block_size", "mismatch", lambda a, l: BS * 2),
        (_op, "q_seq_len", "dtype", lambda a, l: a["q_seq_len"].to(F32)),
        (_op, "q_seq_len", "device", lambda a, l: _meta(a["q_seq_len"])),
        (_op, "kv_seq_len", "size", lambda a, l: torch.tensor([9, 2, 2], dtype=I32)),
        (_op, "kv_seq_len", "dtype", lambda a, l: a["kv_seq_len"].to(F32)),
        (_op, "num_q_heads", "mismatch", lambda a, l: HQ * 2),
        (_op, "num_kv_heads", "not_divisor", lambda a, l: 3),
        (_op, "alibi_slopes", "size", lambda a, l: torch.ones(HQ - 1, device=device())),
        (_op, "attn_output", "size", lambda a, l, _t=_t: torch.empty(_t, HQ, DV + 1, device=device())),
        (_op, "attn_output", "device", lambda a, l, _t=_t: torch.empty(_t, HQ, DV, device=META)),
    ]
for _op in ("fill_kv_cache", "paged_prefill_attention", "paged_decode_attention"):
    BAD += [  # MLA's value cache is a view of the key cache's first Dv dims: one narrower than the value's
        (_op, "value_cache", "latent_view_narrower", lambda a, l: a["key_cache"][..., : DV // 2]),
    ]
for _op in ("prefill_attention", "paged_prefill_attention", "paged_decode_attention"):
    BAD += [  # the score options (None / -1 / 0 mean off; anything else out of range is refused)
        (_op, "sliding_window", "zero", lambda a, l: 0),
        (_op, "sliding_window", "negative", lambda a, l: -2),
        (_op, "sliding_window", "float", lambda a, l: 4.0),
        (_op, "sliding_window", "bool", lambda a, l: True),
        (_op, "sliding_window", "tuple", lambda a, l: (4, 0)),
        (_op, "logit_softcapping", "negative", lambda a, l: -30.0),
        (_op, "logit_softcapping", "infinite", lambda a, l: float("inf")),
        (_op, "logit_softcapping", "nan", lambda a, l: float("nan")),
        (_op, "logit_softcapping", "string", lambda a, l: "30"),
    ]
BAD += [
    ("paged_prefill_attention", "key", "tokens", lambda a, l: _r(T + 1, HKV, D)),
    ("paged_prefill_attention", "value", "tokens", lambda a, l: _r(T + 1, HKV, DV)),
    ("paged_prefill_attention", "key", "device", lambda a, l: _meta(a["key"])),
]

# Value checks (DLINFER_CHECK_VALUES=1); the bad slot is the last one, so a partial write before the
# check would show in the caches.
BAD_VALUES = [
    ("fill_kv_cache", "kv_indices", "slot_past_cache",
     lambda a, l: torch.tensor([3, 4, 17, 40, NB * BS], dtype=I32, device=device())),
    ("fill_kv_cache", "kv_indices", "negative_slot",
     lambda a, l: torch.tensor([3, 4, 17, 40, -1], dtype=I64, device=device())),
    ("prefill_attention", "q_seq_len", "sum_not_T", lambda a, l: torch.tensor([3, 3], dtype=I32, device=device())),
    ("prefill_attention", "actual_seq_lengths_cpu", "end_not_T", lambda a, l: torch.tensor([3, 4], dtype=I32)),
    ("prefill_attention", "actual_seq_lengths_cpu", "not_cumsum_of_q_seq_len",
     lambda a, l: torch.tensor([2, 5], dtype=I32)),
    *bad_inputs_w8a8.BAD_VALUES,
]
for _op in ("paged_prefill_attention", "paged_decode_attention"):
    _end = T if _op == "paged_prefill_attention" else B
    BAD_VALUES += [
        (_op, "block_table", "id_past_cache", lambda a, l: torch.tensor([[2, NB, 0], [5, 0, 7]], dtype=I32,
                                                                      device=device())),
        (_op, "block_table", "negative_id", lambda a, l: torch.tensor([[2, -3, 0], [5, 0, 7]], dtype=I64,
                                                                    device=device())),
        (_op, "kv_seq_len", "past_table", lambda a, l: torch.tensor([9, 3 * BS + 1], dtype=I32)),
        (_op, "q_seq_len", "end_not_T", lambda a, l, _e=_end: torch.tensor([1, _e + 1], dtype=I32)),
    ]


def expect_raises(exc_type, fn, what):
    """Call fn; return the exception of type exc_type it raises, fail on anything else."""
    try:
        fn()
    except exc_type as exc:
        return exc
    except Exception as exc:
        raise CheckFailed(f"{what}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise CheckFailed(f"{what}: expected {exc_type.__name__}, nothing was raised")


def _expect_rejected(vendor, layout, op, arg, fn, exc=InvalidArgumentError):
    kwargs = good_call(op, layout or "token_major")
    kwargs[arg] = fn(kwargs, layout or "token_major")
    caches = [kwargs[k] for k in ("key_cache", "value_cache") if isinstance(kwargs.get(k), torch.Tensor)
              and kwargs[k].device != META]
    before = [c.clone() for c in caches]
    with value_checks(True):
        err = expect_raises(exc, lambda: getattr(ops, op)(**kwargs), f"{op} with a bad {arg!r}")
    msg = str(err)
    expect(re.search(rf"\b{op}\b", msg), f"message does not name the op {op!r}: {msg}")
    expect(re.search(rf"\b{arg}\b", msg), f"message does not name the argument {arg!r}: {msg}")
    for b, c in zip(before, caches):
        assert_equal(c, b, op, name="cache after a rejected call")


def _rejections(name, entries, layouts):
    out = []
    for op, arg, what, fn in entries:
        for layout in (layouts if op in CACHE_OPS else (None,)):
            out.append(Check(name, params(layout, op, arg, what), op, BAD_INPUT,
                             partial(_expect_rejected, layout=layout, op=op, arg=arg, fn=fn), case=f"{arg}-{what}",
                             layout=layout))
    return out


@suite("bad_argument")
def bad_argument(layouts):
    return _rejections("bad_argument", BAD, layouts)


@suite("bad_value")
def bad_value(layouts):
    return _rejections("bad_value", BAD_VALUES, layouts)


def _good_call(vendor, layout, op):
    """The base call of the tables above is valid (so each rejection is the mutation's doing)."""
    getattr(ops, op)(**good_call(op, layout or "token_major"))


NO_CACHE_OPS = ("rms_norm", "add_rms_norm", "apply_rotary_pos_emb", "silu_and_mul", "linear",
                "moe_gating_topk_softmax", "fused_moe", *bad_inputs_w8a8.OPS)


@suite("good_call_accepted")
def good_call_accepted(layouts):
    return [Check("good_call_accepted", params(layout, op), op, BAD_INPUT, partial(_good_call, layout=layout, op=op),
                  case="good_call", layout=layout) for op in sorted(set(CACHE_OPS)) for layout in layouts]


@suite("good_call_accepted_no_cache")
def good_call_accepted_no_cache(layouts):
    return [Check("good_call_accepted_no_cache", op, op, BAD_INPUT, partial(_good_call, layout=None, op=op),
                  case="good_call") for op in NO_CACHE_OPS]


def _quantised_kv(vendor, layout, op):
    """quant_bits=8 on a vendor without a quantised cache: UnsupportedError naming vendor, op and
    feature; caches untouched."""
    if vendor.supports(FEATURE_KV_QUANT):
        raise Skipped(f"{vendor.name} supports a quantised KV cache")
    kwargs = good_call(op, layout)
    kwargs["quant_bits"] = 8
    before = (kwargs["key_cache"].clone(), kwargs["value_cache"].clone())
    err = expect_raises(UnsupportedError, lambda: getattr(ops, op)(**kwargs), f"{op} with quant_bits=8")
    msg = str(err)
    expect(vendor.name in msg and op in msg and "quant" in msg, f"{op}: the UnsupportedError does not name vendor, "
                                                                 f"op and feature: {msg}")
    assert_equal(kwargs["key_cache"], before[0], op, name="key_cache after a rejected call")
    assert_equal(kwargs["value_cache"], before[1], op, name="value_cache after a rejected call")


@suite("quantised_kv_unsupported")
def quantised_kv_unsupported(layouts):
    return [Check("quantised_kv_unsupported", params(layout, op), op, BAD_INPUT,
                  partial(_quantised_kv, layout=layout, op=op), case="quant_bits_8", layout=layout)
            for op in ("fill_kv_cache", "paged_prefill_attention", "paged_decode_attention") for layout in layouts]
