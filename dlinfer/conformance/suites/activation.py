"""silu_and_mul and linear parity."""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import PARITY, STRIDED, Check, params, suite
from dlinfer.conformance.compare import assert_close, expect
from dlinfer.conformance.inputs import DTYPES, device, gen, randn, seed_of


@dataclass(frozen=True)
class SiluCase:
    id: str
    shape: tuple  # [..., 2I]
    small: bool


SILU_CASES = [
    SiluCase("t1_i64", (1, 128), True),
    SiluCase("t7_i80", (7, 160), True),
    SiluCase("t0_i128", (0, 256), True),
    SiluCase("b2_t3_i96", (2, 3, 192), True),
    SiluCase("t33_i1408", (33, 2816), False),
    SiluCase("t129_i2730", (129, 5460), False),
]


def _silu_and_mul(vendor, case, dtype):
    x = randn(case.shape, dtype, gen(seed_of("silu", case.id, dtype)), scale=3.0)
    expected = ref.silu_and_mul(x)
    out = ops.silu_and_mul(x)
    out_kw = ops.silu_and_mul(x, dim=-1)
    expect(out.dtype == dtype and out.device.type == device().type, f"silu_and_mul: output {out.dtype} on {out.device}")
    assert_close(out, expected, "silu_and_mul")
    assert_close(out_kw, expected, "silu_and_mul", name="output (dim=-1)")


@suite("silu_and_mul")
def silu_and_mul(layouts):
    return [Check("silu_and_mul", params(c.id, dt), "silu_and_mul", PARITY, partial(_silu_and_mul, case=c, dtype=dt),
                  case=c.id, dtype=dt, small=c.small) for c in SILU_CASES for dt in DTYPES]


def _silu_strided_rows(vendor):
    buf = randn((5, 300), torch.float32, gen(3))
    x = buf[:, :256]
    out = ops.silu_and_mul(x)
    assert_close(out, ref.silu_and_mul(x), "silu_and_mul")


@suite("silu_and_mul_strided_rows")
def silu_and_mul_strided_rows(layouts):
    return [Check("silu_and_mul_strided_rows", "", "silu_and_mul", STRIDED, _silu_strided_rows, case="strided_rows")]


@dataclass(frozen=True)
class LinearCase:
    id: str
    lead: tuple  # x's leading dims
    k: int
    n: int
    bias: bool
    small: bool


LINEAR_CASES = [
    LinearCase("t1_k64_n80", (1,), 64, 80, False, True),
    LinearCase("t7_k96_n33_bias", (7,), 96, 33, True, True),
    LinearCase("t0_k128_n64", (0,), 128, 64, False, True),
    LinearCase("b1_t5_k80_n48_bias", (1, 5), 80, 48, True, True),
    LinearCase("t37_k4096_n1000_bias", (37,), 4096, 1000, True, False),
    LinearCase("t129_k1000_n3072", (129,), 1000, 3072, False, False),
    LinearCase("b2_t3_k2048_n5120", (2, 3), 2048, 5120, False, False),
    # few rows, K not a multiple of any vector width, odd N (row-pair kernels end on one row),
    # weights large enough to be split across threads
    LinearCase("t1_k2000_n601_bias", (1,), 2000, 601, True, False),
    LinearCase("t8_k1000_n257", (8,), 1000, 257, False, False),
    LinearCase("t5_k100_n70_bias", (5,), 100, 70, True, True),
    LinearCase("t9_k333_n65", (9,), 333, 65, False, True),
    # 16-bit few-row kernels: K one past the 32 bf16 pairs of a dot-product instruction; a K as in
    # an MLP down projection with an odd N split between threads
    LinearCase("t3_k33_n9_bias", (3,), 33, 9, True, True),
    LinearCase("t6_k1536_n577", (6,), 1536, 577, False, False),
]


def _linear(vendor, case, dtype):
    g = gen(seed_of("linear", case.id, dtype))
    x = randn((*case.lead, case.k), dtype, g)
    w = randn((case.n, case.k), dtype, g, scale=case.k**-0.5)
    b = randn((case.n,), dtype, g, scale=0.5) if case.bias else None
    expected = ref.linear(x, w, b)
    out = ops.linear(x, w, bias=b, all_reduce=False, group="")
    out_pos = ops.linear(x, w, b)
    expect(out.dtype == dtype and out.device.type == device().type, f"linear: output {out.dtype} on {out.device}")
    assert_close(out, expected, "linear")
    assert_close(out_pos, expected, "linear", name="output (positional bias)")


@suite("linear")
def linear(layouts):
    return [Check("linear", params(c.id, dt), "linear", PARITY, partial(_linear, case=c, dtype=dt), case=c.id,
                  dtype=dt, small=c.small) for c in LINEAR_CASES for dt in DTYPES]
