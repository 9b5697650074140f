"""linear_w8a8_static (ModelSlim static W8A8) and apply_rotary_pos_emb_interleaved (adjacent-pair
RoPE), the two ops LMDeploy's dlinfer layers call for Ascend-quantised and DeepSeek-V4-style
models: parity against float64 references, rejected calls.

linear_w8a8_static: the activation quantisation follows the contract's float32 steps exactly
(the reference's), including ties and clamped values; the integer product and the int32 bias are
exact; the output within the tolerance table. apply_rotary_pos_emb_interleaved: LMDeploy's
[T, Hq + Hkv, 1, D] input, both output layouts, against a per-pair float64 loop.
"""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import BAD_INPUT, PARITY, Check, params, parity_per_case, suite
from dlinfer.conformance.compare import assert_close, expect
from dlinfer.conformance.inputs import DTYPES, device, gen, randn, seed_of, value_checks
from dlinfer.conformance.suites.bad_inputs import META, expect_raises
from dlinfer.errors import InvalidArgumentError

I8, I32, F32 = torch.int8, torch.int32, torch.float32


@dataclass(frozen=True)
class StaticCase:
    id: str
    shape: tuple  # x [..., K]
    n: int
    bias: bool = True
    small: bool = True


STATIC_CASES = [
    StaticCase("t1_k64_n48", (1, 64), 48),
    StaticCase("t7_k77_n33_nobias", (7, 77), 33, bias=False),
    StaticCase("t0_k32_n16", (0, 32), 16),
    StaticCase("b2_t3_k40_n24", (2, 3, 40), 24),
    StaticCase("t33_k1024_n200", (33, 1024), 200, small=False),
]


def _static_args(case, dtype, g):
    x = randn(case.shape, dtype, g, scale=2.0)
    rows = x.view(-1, case.shape[-1])
    if rows.shape[0] and rows.shape[1] >= 8:  # ties (scale 1/8, offset 3: x / s + o lands on k + 1/2) and clamps
        rows[0, :8] = torch.tensor([0.0625, -0.0625, 0.1875, 40.0, -40.0, 0.3125, -0.4375, 1.0], dtype=dtype)
    weight = torch.randint(-128, 128, (case.n, case.shape[-1]), generator=g, dtype=torch.int64).to(I8).to(device())
    input_scale = torch.tensor([0.125], dtype=dtype, device=device())
    input_offset = torch.tensor([3], dtype=I8, device=device())
    deq_scale = (torch.rand(case.n, generator=g, dtype=torch.float64) / 2000 + 1e-5).to(F32).to(device())
    bias = (torch.randint(-5000, 5000, (case.n,), generator=g).to(I32).to(device()) if case.bias else None)
    return x, weight, input_scale, input_offset, deq_scale, bias


def _static(vendor, case, dtype):
    g = gen(seed_of("w8a8_static", case.id, dtype))
    x, weight, s, o, deq, bias = _static_args(case, dtype, g)
    expected = ref.linear_w8a8_static(x, weight, s, o, deq, bias)
    # the call of lmdeploy/pytorch/kernels/dlinfer/w8a8_kernels.py
    out = ops.linear_w8a8_static(x, weight, s, o, deq, dtype, torch.int8, bias)
    expect(out.dtype == dtype and tuple(out.shape) == (*case.shape[:-1], case.n),
           f"linear_w8a8_static: output {out.dtype} {tuple(out.shape)}")
    assert_close(out, expected, "linear_w8a8_static")


@suite("linear_w8a8_static")
def linear_w8a8_static(layouts):
    return parity_per_case("linear_w8a8_static", _static, STATIC_CASES)


@dataclass(frozen=True)
class RopeCase:
    id: str
    T: int
    hq: int
    hkv: int
    d: int
    small: bool = True


ROPE_CASES = [
    RopeCase("t1_h2_1_d64", 1, 2, 1, 64),
    RopeCase("t5_h4_2_d2", 5, 4, 2, 2),
    RopeCase("t9_h8_1_d128", 9, 8, 1, 128),
    RopeCase("t0_h2_2_d64", 0, 2, 2, 64),
    RopeCase("t300_h16_4_d64", 300, 16, 4, 64, small=False),
]


def _rope(vendor, case, dtype, native):
    g = gen(seed_of("rope_interleaved", case.id, dtype))
    x = randn((case.T, case.hq + case.hkv, 1, case.d), dtype, g)
    angle = torch.rand(case.T, case.d // 2, generator=g, dtype=torch.float64) * 50
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype).to(device()).view(case.T, 1, 1, case.d)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype).to(device()).view(case.T, 1, 1, case.d)
    before = x.clone()
    h = case.hq + case.hkv
    expected = ref.apply_rotary_pos_emb_interleaved(x.view(case.T, h, case.d), cos, sin, native)
    out = ops.apply_rotary_pos_emb_interleaved(x, cos, sin, native)
    expect(out.shape == x.shape and out.dtype == dtype and (not x.numel() or out.data_ptr() != x.data_ptr()),
           f"apply_rotary_pos_emb_interleaved: a new {tuple(x.shape)} {dtype} tensor expected")
    expect(torch.equal(x, before), "apply_rotary_pos_emb_interleaved modified its input")
    assert_close(out.view(case.T, h, case.d), expected, "apply_rotary_pos_emb_interleaved")


@suite("apply_rotary_pos_emb_interleaved")
def apply_rotary_pos_emb_interleaved(layouts):
    return [Check("apply_rotary_pos_emb_interleaved", params(c.id, dt, "native" if native else "pairs"),
                  "apply_rotary_pos_emb_interleaved", PARITY, partial(_rope, case=c, dtype=dt, native=native),
                  case=c.id, dtype=dt, small=c.small)
            for c in ROPE_CASES for dt in DTYPES for native in (True, False)]


# ---------------------------------------------------------------- rejected calls


def _good(op):
    if op == "linear_w8a8_static":
        x, w, s, o, deq, bias = _static_args(STATIC_CASES[0], F32, gen(0))
        return dict(x=x, weight=w, input_scale=s, input_offset=o, deq_scale=deq, out_dtype=F32,
                    quant_dtype=torch.int8, quant_bias=bias)
    x = torch.zeros(3, 6, 1, 64, device=device())
    return dict(x=x, cos=torch.ones(3, 1, 1, 64, device=device()), sin=torch.zeros(3, 1, 1, 64, device=device()),
                return_native_layout=True)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device=META)


BAD = [
    ("linear_w8a8_static", "x", "int8", lambda a: a["x"].to(I8)),
    ("linear_w8a8_static", "weight", "k", lambda a: a["weight"][:, :-1]),
    ("linear_w8a8_static", "weight", "float", lambda a: a["weight"].float()),
    ("linear_w8a8_static", "input_scale", "two", lambda a: torch.ones(2, device=device())),
    ("linear_w8a8_static", "input_scale", "int", lambda a: torch.ones(1, dtype=I32, device=device())),
    ("linear_w8a8_static", "input_offset", "device", lambda a: _meta(a["input_offset"])),
    ("linear_w8a8_static", "deq_scale", "size", lambda a: a["deq_scale"][:-1]),
    ("linear_w8a8_static", "deq_scale", "float16", lambda a: a["deq_scale"].half()),
    ("linear_w8a8_static", "out_dtype", "int8", lambda a: I8),
    ("linear_w8a8_static", "quant_dtype", "uint8", lambda a: torch.uint8),
    ("linear_w8a8_static", "quant_bias", "float", lambda a: a["quant_bias"].float()),
    ("linear_w8a8_static", "quant_bias", "size", lambda a: a["quant_bias"][:-1]),
    ("apply_rotary_pos_emb_interleaved", "x", "odd_d", lambda a: torch.zeros(3, 6, 1, 63, device=device())),
    ("apply_rotary_pos_emb_interleaved", "x", "int", lambda a: a["x"].to(I32)),
    ("apply_rotary_pos_emb_interleaved", "cos", "tokens", lambda a: torch.ones(4, 1, 1, 64, device=device())),
    ("apply_rotary_pos_emb_interleaved", "cos", "half_width", lambda a: torch.ones(3, 1, 1, 32, device=device())),
    ("apply_rotary_pos_emb_interleaved", "sin", "device", lambda a: _meta(a["sin"])),
    ("apply_rotary_pos_emb_interleaved", "return_native_layout", "int", lambda a: 1),
]
BAD_VALUES = [
    ("linear_w8a8_static", "input_scale", "zero", lambda a: torch.zeros(1, device=device())),
]


def _rejected(vendor, op, arg, fn, values):
    kwargs = _good(op)
    kwargs[arg] = fn(kwargs)
    with value_checks(values):
        err = expect_raises(InvalidArgumentError, lambda: getattr(ops, op)(**kwargs), f"{op} with a bad {arg!r}")
    expect(op in str(err) and arg in str(err), f"message does not name the op {op!r} and the argument {arg!r}: {err}")


@suite("ascend_quant_rope_bad_argument")
def ascend_quant_rope_bad_argument(layouts):
    return [Check("ascend_quant_rope_bad_argument", params(op, arg, what), op, BAD_INPUT,
                  partial(_rejected, op=op, arg=arg, fn=fn, values=values), case=f"{arg}-{what}")
            for entries, values in ((BAD, False), (BAD_VALUES, True)) for op, arg, what, fn in entries]
