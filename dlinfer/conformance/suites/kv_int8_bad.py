"""Rejected int8 KV cache calls (quant_bits=8): scales and zeros of the wrong shape, dtype or
device, a cache dtype that does not match quant_bits, bad scale values (value checks on), and
quant_bits=4, which is refused by name (UnsupportedError) on every vendor.

Every mutation breaks one argument of a valid quantised call (`good_quant_call`); the op must
raise InvalidArgumentError naming the op and the argument before anything is written.
"""

from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance.checks import BAD_INPUT, Check, params, suite
from dlinfer.conformance.compare import assert_equal, expect
from dlinfer.conformance.inputs import device, value_checks
from dlinfer.conformance.suites.bad_inputs import HKV, META, _expect_rejected, expect_raises, good_call
from dlinfer.errors import InvalidArgumentError, UnsupportedError
from dlinfer.vendor.base import FEATURE_KV_QUANT

I8, F32, F16, I32 = torch.int8, torch.float32, torch.float16, torch.int32
QUANT_OPS = ("fill_kv_cache", "paged_prefill_attention", "paged_decode_attention")


def _t(values, dtype=F32):
    return torch.tensor(values, dtype=dtype, device=device())


def good_quant_call(op, layout):
    """good_call(op, layout) turned into a valid quant_bits=8 call: int8 caches, per-head scales."""
    kwargs = good_call(op, layout)
    for name in ("key_cache", "value_cache"):
        kwargs[name] = torch.zeros(kwargs[name].shape, dtype=I8, device=device())
    kwargs["quant_bits"] = 8
    if op == "fill_kv_cache":
        kwargs["k_scales_zeros"] = [_t([0.02, 0.03]), _t([0.0, 1.0])]
        kwargs["v_scales_zeros"] = [_t([0.05]), _t([-2.0])]
    else:
        kwargs["kv_scales"] = _t([[0.02, 0.03], [0.05, 0.05]])
        kwargs["kv_zeros"] = _t([[0.0, 1.0], [-2.0, -2.0]])
    return kwargs


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device=META)


BAD = [
    ("fill_kv_cache", "k_scales_zeros", "one_tensor", lambda a, l: [a["k_scales_zeros"][0]]),
    ("fill_kv_cache", "k_scales_zeros", "a_tensor", lambda a, l: _t([0.02, 0.0])),
    ("fill_kv_cache", "k_scales_zeros", "scale_heads", lambda a, l: [_t([0.1, 0.1, 0.1]), a["k_scales_zeros"][1]]),
    ("fill_kv_cache", "k_scales_zeros", "scale_rank", lambda a, l: [_t([[0.1, 0.1]]), a["k_scales_zeros"][1]]),
    ("fill_kv_cache", "k_scales_zeros", "scale_int", lambda a, l: [_t([1, 1], I32), a["k_scales_zeros"][1]]),
    ("fill_kv_cache", "k_scales_zeros", "scale_None", lambda a, l: [None, a["k_scales_zeros"][1]]),
    ("fill_kv_cache", "v_scales_zeros", "zero_heads", lambda a, l: [a["v_scales_zeros"][0], _t([0.0, 0.0, 0.0])]),
    ("fill_kv_cache", "v_scales_zeros", "zero_device", lambda a, l: [a["v_scales_zeros"][0],
                                                                    _meta(a["v_scales_zeros"][1])]),
    ("fill_kv_cache", "key_cache", "float_cache", lambda a, l: torch.zeros(a["key_cache"].shape, device=device())),
    ("fill_kv_cache", "value_cache", "int16_cache", lambda a, l: a["value_cache"].to(torch.int16)),
    ("fill_kv_cache", "quant_bits", "three", lambda a, l: 3),
    ("fill_kv_cache", "quant_bits", "str", lambda a, l: "8"),
]
for _op in ("paged_prefill_attention", "paged_decode_attention"):
    BAD += [
        (_op, "kv_scales", "None", lambda a, l: None),
        (_op, "kv_scales", "three", lambda a, l: _t([0.1, 0.1, 0.1])),
        (_op, "kv_scales", "heads", lambda a, l: _t([[0.1] * (HKV + 1)] * 2)),
        (_op, "kv_scales", "rank3", lambda a, l: _t([[[0.1, 0.1]], [[0.1, 0.1]]])),
        (_op, "kv_scales", "dtype", lambda a, l: _t([1, 1], I32)),
        (_op, "kv_scales", "device", lambda a, l: _meta(a["kv_scales"])),
        (_op, "kv_zeros", "heads", lambda a, l: _t([[0.0] * (HKV + 1)] * 2)),
        (_op, "kv_zeros", "list", lambda a, l: [0.0, 0.0]),
        (_op, "key_cache", "float_cache", lambda a, l: torch.zeros(a["key_cache"].shape, device=device())),
        (_op, "value_cache", "uint8_with_int8_key", lambda a, l: a["value_cache"].view(torch.uint8)),
        (_op, "quant_bits", "sixteen", lambda a, l: 16),
    ]

BAD_VALUES = [
    ("fill_kv_cache", "k_scales_zeros", "scale_zero", lambda a, l: [_t([0.0, 0.1]), a["k_scales_zeros"][1]]),
    ("fill_kv_cache", "v_scales_zeros", "scale_negative", lambda a, l: [_t([-0.1]), a["v_scales_zeros"][1]]),
    ("fill_kv_cache", "v_scales_zeros", "zero_nan", lambda a, l: [a["v_scales_zeros"][0], _t([float("nan")])]),
]
for _op in ("paged_prefill_attention", "paged_decode_attention"):
    BAD_VALUES += [
        (_op, "kv_scales", "inf", lambda a, l: _t([0.1, float("inf")])),
        (_op, "kv_zeros", "inf", lambda a, l: _t([0.0, float("-inf")])),
    ]


def _rejected(vendor, layout, op, arg, fn):
    kwargs = good_quant_call(op, layout)
    kwargs[arg] = fn(kwargs, layout)
    caches = [kwargs["key_cache"], kwargs["value_cache"]]
    before = [c.clone() for c in caches]
    with value_checks(True):
        err = expect_raises(InvalidArgumentError, lambda: getattr(ops, op)(**kwargs), f"{op} with a bad {arg!r}")
    msg = str(err)
    expect(op in msg and arg in msg, f"message does not name the op {op!r} and the argument {arg!r}: {msg}")
    for b, c in zip(before, caches):
        assert_equal(c, b, op, name="cache after a rejected call")


def _checks(name, entries, layouts):
    return [Check(name, params(layout, op, arg, what), op, BAD_INPUT,
                  partial(_rejected, layout=layout, op=op, arg=arg, fn=fn), case=f"{arg}-{what}", layout=layout,
                  feature=FEATURE_KV_QUANT)
            for op, arg, what, fn in entries for layout in layouts]


@suite("kv_int8_bad_argument")
def kv_int8_bad_argument(layouts):
    checks = _checks("kv_int8_bad_argument", BAD, layouts)
    # quant_bits=0 with an int8 cache, or with scales: the unquantised call is the broken one.
    for op in QUANT_OPS:
        for layout in layouts:
            checks.append(Check("kv_int8_bad_argument", params(layout, op, "int8_cache_without_quant_bits"), op,
                                BAD_INPUT, partial(_expect_rejected, layout=layout, op=op, arg="key_cache",
                                                   fn=lambda a, l: torch.zeros(a["key_cache"].shape, dtype=I8,
                                                                               device=device())),
                                case="key_cache-int8_without_quant_bits", layout=layout))
    for op, arg, bad in (("fill_kv_cache", "k_scales_zeros", lambda a, l: [_t([0.1]), _t([0.0])]),
                         ("paged_decode_attention", "kv_scales", lambda a, l: _t([0.1, 0.1])),
                         ("paged_prefill_attention", "kv_zeros", lambda a, l: _t([0.0, 0.0]))):
        checks.append(Check("kv_int8_bad_argument", params(layouts[0], op, arg, "given_with_quant_bits_0"), op,
                            BAD_INPUT, partial(_expect_rejected, layout=layouts[0], op=op, arg=arg, fn=bad),
                            case=f"{arg}-given_with_quant_bits_0", layout=layouts[0]))
    return checks


@suite("kv_int8_bad_value")
def kv_int8_bad_value(layouts):
    return _checks("kv_int8_bad_value", BAD_VALUES, layouts)


def _int4(vendor, layout, op):
    """quant_bits=4 (LMDeploy's int4 cache): UnsupportedError naming it, whatever the vendor."""
    kwargs = good_quant_call(op, layout)
    kwargs["quant_bits"] = 4
    before = (kwargs["key_cache"].clone(), kwargs["value_cache"].clone())
    err = expect_raises(UnsupportedError, lambda: getattr(ops, op)(**kwargs), f"{op} with quant_bits=4")
    expect("quant_bits=4" in str(err) and op in str(err), f"{op}: the error does not name quant_bits=4: {err}")
    assert_equal(kwargs["key_cache"], before[0], op, name="key_cache after a rejected call")
    assert_equal(kwargs["value_cache"], before[1], op, name="value_cache after a rejected call")


@suite("kv_int4_refused")
def kv_int4_refused(layouts):
    return [Check("kv_int4_refused", params(layout, op), op, BAD_INPUT, partial(_int4, layout=layout, op=op),
                  case="quant_bits_4", layout=layout) for op in QUANT_OPS for layout in layouts]
