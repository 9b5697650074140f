"""W4A16 (`weight_quant_matmul`, LMDeploy's AWQ gemm layout) against the fp64 reference: parity,
a strided x, the column_tiled layout (built here, and as the vendor's `repack_weight_quant`
returns it), the k_interleaved layout (built here), bad inputs.

The weights are packed here, from the contract's words (nibble i of word j holds column
8 * j + [0, 2, 4, 6, 1, 3, 5, 7][i]), and unpacked by the reference's own code
(dlinfer/conformance/reference.py): nothing of the code under test builds or reads them.

Adversarial: M = 1, 2, 7, 64 and empty batches; K not a multiple of 64 (80, 96, 160); N not a
multiple of 128 (a partial column tile); group sizes 32, 64, 128 and 0 (one group of K, 72 rows
in one case: no power-of-two K step of 16 or more fits in its group);
offset None (zero point 8); bias; leading dims; extreme nibbles (15 - 0 and 0 - 15, every word's
top nibble set, i.e. negative int32 words).
"""

from dataclasses import dataclass
from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import BAD_INPUT, PARITY, STRIDED, Check, params, parity_per_case, suite
from dlinfer.conformance.compare import assert_close, expect
from dlinfer.conformance.inputs import DTYPES, device, gen, randn, seed_of
from dlinfer.errors import InvalidArgumentError

OP = "weight_quant_matmul"
I32 = torch.int32


@dataclass(frozen=True)
class W4Case:
    id: str
    lead: tuple  # x's leading dims
    k: int
    n: int
    group: int  # group_size as passed (0: one group)
    zeros: bool = True  # offset given (else None: zero point 8)
    bias: bool = False
    fill: str = "random"  # or "extreme"
    small: bool = True


CASES = [
    W4Case("m1_k64_n64_g32", (1,), 64, 64, 32),
    W4Case("m2_k192_n128_g64_nozero", (2,), 192, 128, 64, zeros=False),
    W4Case("m7_k96_n136_g32_bias", (7,), 96, 136, 32, bias=True),
    W4Case("m1_k80_n48_g0", (1,), 80, 48, 0, bias=True),
    W4Case("m64_k256_n256_g128", (64,), 256, 256, 128),
    W4Case("m7_k160_n264_g32_extreme", (7,), 160, 264, 32, fill="extreme"),
    W4Case("m0_k64_n64_g64", (0,), 64, 64, 64),
    W4Case("b1_t5_k128_n40_g0_nozero", (1, 5), 128, 40, 0, zeros=False, bias=True),
    # one group of 72 rows: no power-of-two K step of 16 or more stays inside a group
    W4Case("m3_k72_n64_g0", (3,), 72, 64, 0),
    # a last 128-column tile of 12 words: an AVX2 kernel's second 8-word half is partial
    W4Case("m2_k64_n224_g32", (2,), 64, 224, 32),
    W4Case("m8_k576_n1536_g64", (8,), 576, 1536, 64, small=False),
    W4Case("m33_k4096_n520_g128_bias", (33,), 4096, 520, 128, bias=True, small=False),
    W4Case("m3_k1024_n384_g0", (3,), 1024, 384, 0, small=False),
    W4Case("m4100_k64_n200_g32_bias", (4100,), 64, 200, 32, bias=True, small=False),  # past 4096 rows
]


def awq_pack(values):
    """int64 [R, N] of 0..15 -> int32 [R, N/8], the AWQ gemm packing (the contract's words)."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    v = values.to(torch.int64)
    words = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        words |= v[:, col::8] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(I32)  # the same 32 bits, as int32


def weights(case, dtype, g):
    """(qweight, scale, offset or None, bias or None) on the checks' device, from seed g."""
    K, N = case.k, case.n
    groups = K // (case.group or K)
    if case.fill == "extreme":  # q - z = +15 or -15 everywhere, every word's top nibble set in half
        q = torch.full((K, N), 15, dtype=torch.int64)
        q[:, 1::2] = 0
        z = torch.zeros(groups, N, dtype=torch.int64)
        z[:, 1::2] = 15
    else:
        q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int64)
        z = torch.randint(0, 16, (groups, N), generator=g, dtype=torch.int64)
    # |x @ W| ~ 1: K terms of |q - z| ~ 5 times s
    s = (torch.rand(groups, N, generator=g, dtype=torch.float64) + 0.5) / (5.0 * K**0.5)
    s = torch.where(torch.rand(groups, N, generator=g) < 0.5, -s, s)
    dev = device()
    offset = awq_pack(z).to(dev) if case.zeros else None
    bias = randn((N,), dtype, g) if case.bias else None
    return awq_pack(q).to(dev), s.to(dtype=dtype, device=dev), offset, bias


def column_tile(qweight):
    """canonical int32 [K, N/8] -> column_tiled int32 [ceil(N/128), K, 16] (the layout's nibbles
    regrouped: tile t, row k, word w, bits 4i..4i+3 = column 128t + 16i + w; zero past N)."""
    k, words = qweight.shape
    n = 8 * words
    q = qweight.to(torch.int64) & 0xFFFFFFFF
    values = torch.zeros(k, n, dtype=torch.int64, device=qweight.device)
    for p, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):  # the canonical word's nibble p holds column 8j + col
        values[:, col::8] = (q >> (4 * p)) & 15
    tiles = -(-n // 128)
    out = torch.zeros(tiles, k, 16, dtype=torch.int64, device=qweight.device)
    for c in range(n):
        t, i, w = c // 128, (c % 128) // 16, c % 16
        out[t, :, w] |= values[:, c] << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def k_interleave(qweight, scale, offset, group):
    """canonical int32 [K, N/8], scale [K/g, N], offset or None, g (0: K) -> k_interleaved uint8
    [ceil(N/64), K/g, B], built from the layout's words: per tile t and group gi a block holding
    the 64 columns' scales (float16 when every scale is a float16 value, else float32), their 64
    zero points (a byte each; 8 without offset), then g/8 x 4 lines: line (b, v), byte 4l + r holds
    row g gi + 8b + r of column 64t + 16v + l in the low nibble, row g gi + 8b + 4 + r in the high
    one; zero past N."""
    k, words = qweight.shape
    n, g = 8 * words, group or k
    groups, tiles = k // g, -(-n // 64)

    def values_of(packed):
        q = packed.to(torch.int64) & 0xFFFFFFFF
        out = torch.zeros(packed.shape[0], n, dtype=torch.int64, device=packed.device)
        for p, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
            out[:, col::8] = (q >> (4 * p)) & 15
        return out

    def padded(t):  # [rows, n] -> [rows, 64 * tiles] on the CPU, zero past N
        return torch.nn.functional.pad(t.cpu(), (0, 64 * tiles - n))

    values = padded(values_of(qweight))  # [K, 64 tiles]
    zeros = padded(values_of(offset) if offset is not None else torch.full((groups, n), 8, dtype=torch.int64))
    sdtype = torch.float16 if torch.equal(scale.to(torch.float16).to(scale.dtype), scale) else torch.float32
    # the block's head: 64 scales (their bytes, in column order), then 64 zero-point bytes
    scales = padded(scale.to(sdtype)).view(groups, tiles, 64).transpose(0, 1).contiguous().view(torch.uint8)
    zero_bytes = zeros.view(groups, tiles, 64).transpose(0, 1).to(torch.uint8)
    # row g gi + 8b + 4h + r, column 64t + 16v + l -> [gi, b, h, r, t, v, l]; the byte pairs h = 0 / 1
    rows = values.view(groups, g // 8, 2, 4, tiles, 4, 16)
    nibbles = rows[:, :, 0] | (rows[:, :, 1] << 4)  # [gi, b, r, t, v, l]
    lines = nibbles.permute(3, 0, 1, 4, 5, 2).reshape(tiles, groups, g // 8 * 256)  # byte (4b + v) 64 + 4l + r
    out = torch.cat([scales.view(tiles, groups, -1), zero_bytes, lines.to(torch.uint8)], dim=-1)
    return out.to(qweight.device)


def _check(out, expected, case, dtype, what=OP):
    expect(out.dtype == dtype and tuple(out.shape) == (*case.lead, case.n),
           f"{what}: output {tuple(out.shape)} {out.dtype}, expected {(*case.lead, case.n)} {dtype}")
    assert_close(out, expected, OP)


def _parity(vendor, case, dtype, strided=False, tiled=False, half_scales=False):
    g = gen(seed_of("w4a16", case.id, dtype))
    qweight, scale, offset, bias = weights(case, dtype, g)
    if half_scales:  # float16 scales whatever x's dtype (an AWQ checkpoint's own)
        scale = scale.to(torch.float16)
    if strided:  # x's rows strided (a column slice of a wider tensor), as a packed qkv view is
        x = randn((*case.lead, case.k + 24), dtype, g)[..., 8:8 + case.k]
        expect(not x.is_contiguous(), "strided case: x is contiguous")
    else:
        x = randn((*case.lead, case.k), dtype, g)
    expected = ref.weight_quant_matmul(x, qweight, scale, offset, bias, case.group)
    if tiled == "suite":  # the column_tiled layout, built here
        qweight = column_tile(qweight)
    elif tiled == "suite_k_interleaved":  # the k_interleaved layout, built here
        qweight = k_interleave(qweight, scale, offset, case.group)
    elif tiled == "vendor":  # whatever the active vendor's load-time repack returns
        qweight, scale, offset = ops.repack_weight_quant(qweight, scale, offset, case.group)
    out = ops.weight_quant_matmul(x, qweight, scale, offset=offset, bias=bias, all_reduce=False,
                                  group_size=case.group)
    _check(out, expected, case, dtype)


@suite("weight_quant_matmul")
def weight_quant_matmul(layouts):
    return parity_per_case(OP, _parity, CASES)


TILED_CASES = [c for c in CASES if c.id in ("m1_k64_n64_g32", "m7_k96_n136_g32_bias", "m64_k256_n256_g128",
                                             "m7_k160_n264_g32_extreme", "m8_k576_n1536_g64", "m1_k80_n48_g0")]


@suite("weight_quant_matmul_column_tiled")
def weight_quant_matmul_column_tiled(layouts):
    """qweight in the column_tiled layout (built by the suite), and as the vendor's
    `repack_weight_quant` hook returns it (the canonical tensors when it has none)."""
    return [Check("weight_quant_matmul_column_tiled", params(how, c.id, dt), OP, PARITY,
                  partial(_parity, case=c, dtype=dt, tiled=how), case=f"{how}-{c.id}", dtype=dt, small=c.small)
            for how in ("suite", "vendor") for c in TILED_CASES for dt in DTYPES]


# the k_interleaved layout needs K and g multiples of 8 (every case here has them; g0 at K = 80 is one
# group of 80 rows)
KI_CASES = TILED_CASES + [c for c in CASES if c.id in ("m2_k192_n128_g64_nozero", "b1_t5_k128_n40_g0_nozero",
                                                       "m33_k4096_n520_g128_bias", "m0_k64_n64_g64")]


@suite("weight_quant_matmul_k_interleaved")
def weight_quant_matmul_k_interleaved(layouts):
    """qweight in the k_interleaved layout (built by the suite): every vendor reads it (the cpu
    vendor with its integer kernel, the others as canonical)."""
    return [Check("weight_quant_matmul_k_interleaved", params(c.id, dt), OP, PARITY,
                  partial(_parity, case=c, dtype=dt, tiled="suite_k_interleaved"), case=c.id, dtype=dt, small=c.small)
            for c in KI_CASES for dt in DTYPES]


@suite("weight_quant_matmul_half_scales")
def weight_quant_matmul_half_scales(layouts):
    """float16 scales with x in every dtype (the op widens them exactly), canonical and column_tiled."""
    return [Check("weight_quant_matmul_half_scales", params(how, c.id, dt), OP, PARITY,
                  partial(_parity, case=c, dtype=dt, tiled=how, half_scales=True), case=f"{how}-{c.id}", dtype=dt,
                  small=c.small)
            for how in ("canonical", "suite", "suite_k_interleaved") for c in TILED_CASES for dt in DTYPES]


STRIDED_CASES = [c for c in CASES if c.id in ("m7_k96_n136_g32_bias", "b1_t5_k128_n40_g0_nozero")]


@suite("weight_quant_matmul_strided")
def weight_quant_matmul_strided(layouts):
    return [Check("weight_quant_matmul_strided", params(c.id, dt), OP, STRIDED,
                  partial(_parity, case=c, dtype=dt, strided=True), case=c.id, dtype=dt, small=c.small)
            for c in STRIDED_CASES for dt in DTYPES]


# ---------------------------------------------------------------- bad inputs

def good_call():
    """Keyword arguments of a valid small float32 call: K 64, N 48, g 32."""
    g = gen(7)
    case = W4Case("good", (5,), 64, 48, 32, bias=True)
    qweight, scale, offset, bias = weights(case, torch.float32, g)
    return dict(x=randn((5, 64), torch.float32, g), qweight=qweight, scale=scale, offset=offset, bias=bias,
                all_reduce=False, group_size=32)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _i32(*shape):
    return torch.zeros(shape, dtype=I32, device=device())


def _u8(*shape):
    return torch.zeros(shape, dtype=torch.uint8, device=device())


# (argument, what, new value: fn(good kwargs) -> value); each breaks one argument against the others
BAD = [
    ("x", "dtype", lambda a: a["x"].to(I32)),
    ("x", "rank", lambda a: torch.tensor(1.0, device=device())),
    ("qweight", "rows", lambda a: _i32(63, 6)),
    ("qweight", "cols", lambda a: _i32(64, 7)),
    ("qweight", "rank", lambda a: _i32(64 * 6)),
    ("qweight", "dtype", lambda a: a["qweight"].to(torch.int64)),
    ("qweight", "uint8", lambda a: torch.zeros(48, 32, dtype=torch.uint8, device=device())),
    ("qweight", "device", lambda a: _meta(a["qweight"])),
    ("qweight", "tiled_tiles", lambda a: _i32(2, 64, 16)),
    ("qweight", "tiled_words", lambda a: _i32(1, 64, 8)),
    ("qweight", "tiled_rows", lambda a: _i32(1, 65, 16)),
    ("qweight", "k_interleaved_tiles", lambda a: _u8(2, 2, 320 + 32 * 32)),
    ("qweight", "k_interleaved_groups", lambda a: _u8(1, 3, 320 + 32 * 32)),
    ("qweight", "k_interleaved_block", lambda a: _u8(1, 2, 320 + 32 * 32 + 64)),
    ("qweight", "k_interleaved_group_size", lambda a: _u8(1, 2, 320 + 32 * 16)),
    ("qweight", "k_interleaved_rank4", lambda a: _u8(1, 8, 4, 64)),
    ("scale", "dtype", lambda a: a["scale"].to(torch.bfloat16)),  # float16 is allowed, bfloat16 is not
    ("scale", "float64", lambda a: a["scale"].to(torch.float64)),
    ("scale", "int", lambda a: a["scale"].to(I32)),
    ("scale", "groups", lambda a: torch.ones(3, 48, device=device())),
    ("scale", "n_not_multiple_of_8", lambda a: torch.ones(2, 44, device=device())),
    ("scale", "rank", lambda a: torch.ones(96, device=device())),
    ("scale", "device", lambda a: _meta(a["scale"])),
    ("offset", "groups", lambda a: _i32(1, 6)),
    ("offset", "cols", lambda a: _i32(2, 48)),
    ("offset", "dtype", lambda a: a["offset"].to(torch.uint8)),
    ("offset", "device", lambda a: _meta(a["offset"])),
    ("bias", "size", lambda a: torch.ones(47, device=device())),
    ("bias", "dtype", lambda a: a["bias"].to(torch.bfloat16)),
    ("bias", "device", lambda a: _meta(a["bias"])),
    ("group_size", "not_divisor", lambda a: 48),
    ("group_size", "negative", lambda a: -32),
    ("group_size", "float", lambda a: 32.0),
    ("all_reduce", "not_bool", lambda a: "yes"),
]


def _expect_rejected(vendor, arg, fn):
    kwargs = good_call()
    kwargs[arg] = fn(kwargs)
    try:
        ops.weight_quant_matmul(**kwargs)
    except InvalidArgumentError as exc:
        msg = str(exc)
        expect(OP in msg and arg in msg, f"the message does not name the op and {arg!r}: {msg}")
        return
    except Exception as exc:  # noqa: BLE001  (anything else is the failure reported)
        expect(False, f"{OP} with a bad {arg!r}: expected InvalidArgumentError, got {type(exc).__name__}: {exc}")
    expect(False, f"{OP} with a bad {arg!r}: nothing was raised")


def _good(vendor):
    out = ops.weight_quant_matmul(**good_call())
    expect(tuple(out.shape) == (5, 48), f"good call: output {tuple(out.shape)}")


@suite("weight_quant_matmul_bad_argument")
def weight_quant_matmul_bad_argument(layouts):
    checks = [Check("weight_quant_matmul_bad_argument", params(arg, what), OP, BAD_INPUT,
                    partial(_expect_rejected, arg=arg, fn=fn), case=f"{arg}-{what}") for arg, what, fn in BAD]
    checks.append(Check("weight_quant_matmul_bad_argument", "good_call", OP, BAD_INPUT, _good, case="good_call"))
    return checks
