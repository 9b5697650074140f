"""Inputs whose last dim is not dense (every other element of a wider buffer, NaN in the gaps,
127 for int8; weights as transposed views; strided index and length tensors; a strided attn_output; caches
whose head dim is strided).

A vendor either computes the right result from them or says it cannot take them by raising
InvalidArgumentError naming the op (from its own function: dlinfer.ops does not require dense
tensors), with nothing written; a raw RuntimeError from a kernel, or a wrong result (a kernel that
ignores the stride reads the NaN gaps), fails the check.
"""

from functools import partial

import torch

import dlinfer.ops as ops
from dlinfer.conformance import reference as ref
from dlinfer.conformance.checks import STRIDED, Check, params, suite
from dlinfer.conformance.compare import CheckFailed, assert_close, assert_equal, expect
from dlinfer.conformance.inputs import (
    alloc_cache,
    device,
    every_other,
    gen,
    make_block_table,
    randn,
    seed_of,
    slots_of,
    write_cache,
)
from dlinfer.conformance.suites.rotary import cos_sin
from dlinfer.errors import InvalidArgumentError

F32, I32, I64 = torch.float32, torch.int32, torch.int64


def _accept(op, call, check, written=()):
    """call(); then check(result). An InvalidArgumentError naming the op also passes, provided
    nothing in `written` changed; returns a note saying so."""
    before = [w.clone() for w in written]
    try:
        result = call()
    except InvalidArgumentError as err:
        expect(op in str(err), f"{op}: the InvalidArgumentError does not name the op: {err}")
        for w, b in zip(written, before):
            assert_equal(w, b, op, name="cache after a rejected call")
        return f"rejected: {err}"
    except Exception as err:
        raise CheckFailed(f"{op} with strided inputs raised {type(err).__name__} (a vendor that needs dense "
                          f"inputs must raise InvalidArgumentError): {err}") from err
    check(result)
    return None


def _r(*shape, seed=0, scale=1.0):
    return randn(shape, F32, gen(seed), scale=scale)


def _rms_norm(vendor):
    x, w = every_other(_r(5, 64, seed=1, scale=3.0)), every_other(1.0 + 0.2 * _r(64, seed=2))
    return _accept("rms_norm", lambda: ops.rms_norm(x, w, 1e-6),
                   lambda out: assert_close(out, ref.rms_norm(x, w, 1e-6), "rms_norm"))


def _add_rms_norm(vendor):
    x, r = every_other(_r(5, 64, seed=1, scale=3.0)), every_other(_r(5, 64, seed=3, scale=2.0))
    w = every_other(1.0 + 0.2 * _r(64, seed=2))

    def check(result):
        normed, summed = result
        assert_equal(summed, x + r, "add_rms_norm", name="residual sum")
        assert_close(normed, ref.add_rms_norm(x, r, w, 1e-6)[0], "add_rms_norm", name="normed")

    return _accept("add_rms_norm", lambda: ops.add_rms_norm(x, r, w, 1e-6), check)


def _rotary(vendor):
    g = gen(seed_of("strided_rope"))
    q, k = every_other(randn((5, 4, 64), F32, g)), every_other(randn((5, 2, 64), F32, g))
    cos, sin = (every_other(t) for t in cos_sin(5, 32, F32, g))

    def check(result):
        exp_q, exp_k = ref.apply_rotary_pos_emb(q, k, cos, sin)
        assert_close(result[0], exp_q, "apply_rotary_pos_emb", name="query")
        assert_close(result[1], exp_k, "apply_rotary_pos_emb", name="key")

    return _accept("apply_rotary_pos_emb", lambda: ops.apply_rotary_pos_emb(q, k, cos, sin), check)


def _silu_and_mul(vendor):
    x = every_other(_r(5, 128, seed=4, scale=3.0))
    return _accept("silu_and_mul", lambda: ops.silu_and_mul(x),
                   lambda out: assert_close(out, ref.silu_and_mul(x), "silu_and_mul"))


def _linear(vendor):
    x = every_other(_r(5, 64, seed=5))
    w = _r(64, 48, seed=6, scale=0.125).t()  # [48, 64], strides (1, 48)
    b = every_other(_r(48, seed=7, scale=0.5))
    return _accept("linear", lambda: ops.linear(x, w, b),
                   lambda out: assert_close(out, ref.linear(x, w, b), "linear"))


def _moe_gating(vendor):
    logits = every_other(_r(5, 8, seed=8, scale=2.0))

    def check(result):
        exp_w, exp_ids = ref.moe_gating_topk_softmax(logits, 2)
        assert_equal(result[1], exp_ids.to(result[1].device), "moe_gating_topk_softmax", name="ids")
        assert_close(result[0], exp_w, "moe_gating_topk_softmax", name="weights")

    return _accept("moe_gating_topk_softmax", lambda: ops.moe_gating_topk_softmax(logits, 2, None), check)


def _fused_moe(vendor):
    T, H, I, E, K = 5, 32, 48, 4, 2  # noqa: E741
    x = every_other(_r(T, H, seed=9))
    gate_up = _r(E, H, 2 * I, seed=10, scale=H**-0.5).transpose(1, 2)  # [E, 2I, H], last-dim stride 2I
    down = _r(E, I, H, seed=11, scale=I**-0.5).transpose(1, 2)  # [E, H, I]
    topk_w = every_other(torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.7, 0.1], [0.2, 0.2], [0.9, 0.05]],
                                      device=device()))
    ids = every_other(torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], dtype=I64, device=device()))
    return _accept("fused_moe", lambda: ops.fused_moe(x, gate_up, down, topk_w, ids, K, True, None, None),
                   lambda out: assert_close(out, ref.fused_moe(x, gate_up, down, topk_w, ids, True), "fused_moe"))


def _fill(vendor, layout, strided_caches):
    g = gen(seed_of("strided_fill", layout, strided_caches))
    key, value = every_other(randn((5, 2, 64), F32, g)), every_other(randn((5, 2, 64), F32, g))
    kc, vc = (alloc_cache(4, 8, 2, 64, layout, F32, g) for _ in range(2))
    if strided_caches:
        kc, vc = every_other(kc), every_other(vc)
    slots = every_other(torch.tensor([3, 9, 30, 17, 0], dtype=I32, device=device()))
    exp_k, exp_v = ref.fill_kv_cache(key, value, kc, vc, slots, layout)

    def check(result):
        assert_equal(kc, exp_k, "fill_kv_cache", name="key_cache")
        assert_equal(vc, exp_v, "fill_kv_cache", name="value_cache")

    bases = (kc._base, vc._base) if strided_caches else (kc, vc)
    gaps = [b[..., 1::2].clone() for b in bases] if strided_caches else []
    note = _accept("fill_kv_cache", lambda: ops.fill_kv_cache(key, value, kc, vc, slots), check, written=bases)
    for b, then in zip(bases, gaps):
        expect(b[..., 1::2].isnan().all() and then.isnan().all(), "fill_kv_cache wrote between the cache's elements")
    return note


# A paged call: seq 0 has 9 cached tokens (3 new), seq 1 has 2 (2 new); T = 5 for prefill, B = 2 for decode.
SEQS = ((6, 3), (0, 2))


def _paged(vendor, layout, op, strided_caches):
    hq, hkv, d, bs = 4, 2, 64, 8
    g = gen(seed_of("strided_paged", layout, op, strided_caches))
    seqs = SEQS if op == "paged_prefill_attention" else ((8, 1), (1, 1))
    kv_lens = [h + n for h, n in seqs]
    paged = make_block_table(kv_lens, bs, g, I32)
    kc, vc = (alloc_cache(paged.num_blocks, bs, hkv, d, layout, F32, g).mul_(30) for _ in range(2))
    for b, (h, n) in enumerate(seqs):
        slots = slots_of(paged, b, range(h + n), bs)
        write_cache(kc, slots, randn((h + n, hkv, d), F32, g), bs, layout)
        write_cache(vc, slots, randn((h + n, hkv, d), F32, g), bs, layout)
    if strided_caches:
        kc, vc = every_other(kc), every_other(vc)
    T = sum(n for _, n in seqs)
    q = every_other(randn((T, hq, d), F32, g))
    table = every_other(paged.block_table)
    ends = every_other(torch.tensor([seqs[0][1], T], dtype=I32, device=device()))
    kv = every_other(torch.tensor(kv_lens, dtype=I32, device=device()))
    out = every_other(torch.empty(T, hq, d, device=device()))
    expected = ref.paged_attention(q, kc, vc, table, bs, ends, kv, layout)
    max_q = max(n for _, n in seqs)
    if op == "paged_prefill_attention":
        call = lambda: ops.paged_prefill_attention(q, None, None, kc, vc, table, bs, ends, kv, max_q,  # noqa: E731
                                                   max(kv_lens), hq, hkv, [], attn_output=out)
    else:
        call = lambda: ops.paged_decode_attention(q, kc, vc, table, bs, ends, kv, max(kv_lens), hq, hkv,  # noqa: E731
                                                  attn_output=out)

    def check(result):
        expect(result.data_ptr() == out.data_ptr() and result.stride() == out.stride(),
               f"{op} must write attn_output and return it")
        assert_close(out, expected, op, name="attn_output")
        expect(out._base[..., 1::2].isnan().all(), f"{op} wrote between attn_output's elements")

    return _accept(op, call, check)


def _prefill(vendor):
    hq, hkv, d = 4, 2, 64
    g = gen(seed_of("strided_prefill"))
    q, k, v = every_other(randn((5, hq, d), F32, g)), every_other(randn((5, hkv, d), F32, g)), \
        every_other(randn((5, hkv, d), F32, g))
    lens = every_other(torch.tensor([3, 2], dtype=I32, device=device()))
    out = every_other(torch.empty(5, hq, d, device=device()))
    expected = ref.prefill_attention(q, k, v, lens)

    def check(result):
        expect(result.data_ptr() == out.data_ptr(), "prefill_attention must write attn_output and return it")
        assert_close(out, expected, "prefill_attention", name="attn_output")

    return _accept("prefill_attention", lambda: ops.prefill_attention(q, k, v, None, None, lens, lens, 3, hq, hkv, [],
                                                                      attn_output=out), check)


def _i8_every_other(shape, seed):
    """An int8 view whose last dim has stride 2, 127 in the gaps (read, they change the result)."""
    vals = torch.randint(-128, 128, shape, generator=gen(seed), dtype=I64).to(torch.int8)
    buf = torch.full((*shape[:-1], 2 * shape[-1]), 127, dtype=torch.int8)
    buf[..., ::2] = vals
    return buf.to(device())[..., ::2]


def _i8_transposed(shape, seed):
    """An int8 [..., R, C] view of a [..., C, R] buffer (last-dim stride R)."""
    t = torch.randint(-128, 128, (*shape[:-2], shape[-1], shape[-2]), generator=gen(seed), dtype=I64)
    return t.to(dtype=torch.int8, device=device()).transpose(-1, -2)


def _dynamic_quant(vendor):
    x = every_other(_r(5, 64, seed=12, scale=3.0))

    def check(result):
        q_ref, s_ref = ref.dynamic_quant(x)
        assert_equal(result[0], q_ref.to(result[0].device), "dynamic_quant", name="xq")
        assert_close(result[1], s_ref, "dynamic_quant", name="scale")

    return _accept("dynamic_quant", lambda: ops.dynamic_quant(x), check)


def _linear_w8a8(vendor):
    a, b = _i8_every_other((5, 48), 13), _i8_transposed((24, 48), 14)
    rms = every_other((0.5 + _r(5, seed=15).abs()) / (74.0 * 48**0.5))
    lin, bias = every_other((0.5 + _r(24, seed=16).abs()) / 74.0), every_other(_r(24, seed=17))
    return _accept("linear_w8a8", lambda: ops.linear_w8a8(a, b, rms, lin, F32, torch.int8, bias),
                   lambda out: assert_close(out, ref.linear_w8a8(a, b, rms, lin, bias), "linear_w8a8"))


def _norm_w8a8(vendor, op):
    from dlinfer.conformance.suites.quant import _check_fused_quant

    x, r = every_other(_r(5, 64, seed=18, scale=3.0)), every_other(_r(5, 64, seed=19, scale=2.0))
    w = every_other(1.0 + 0.2 * _r(64, seed=20))
    if op == "rms_norm_w8a8":
        q_ref, s_ref, _ = ref.rms_norm_w8a8(x, w, 1e-6)
        return _accept(op, lambda: ops.rms_norm_w8a8(x, w, 1e-6),
                       lambda res: _check_fused_quant(op, res[0], res[1], q_ref, s_ref, F32))
    q_ref, s_ref, summed, _ = ref.add_rms_norm_w8a8(x, r, w, 1e-6)

    def check(res):
        _check_fused_quant(op, res[0], res[1], q_ref, s_ref, F32)
        assert_equal(res[2], summed.to(F32).to(res[2].device), op, name="residual sum")

    return _accept(op, lambda: ops.add_rms_norm_w8a8(x, r, w, 1e-6), check)


def _fused_moe_w8a8(vendor):
    T, H, I, E, K = 5, 32, 48, 4, 2  # noqa: E741
    x = every_other(_r(T, H, seed=21))
    gate_up, down = _i8_transposed((E, 2 * I, H), 22), _i8_transposed((E, H, I), 23)
    gu_s = every_other((0.5 + _r(E, 2 * I, seed=24).abs()) / (73 * H**0.5))
    dn_s = every_other((0.5 + _r(E, H, seed=25).abs()) / (73 * I**0.5))
    topk_w = every_other(torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.7, 0.1], [0.2, 0.2], [0.9, 0.05]],
                                      device=device()))
    ids = every_other(torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], dtype=I64, device=device()))
    expected, slack, _ = ref.fused_moe_w8a8(x, gate_up, gu_s, down, dn_s, topk_w, ids, True)
    return _accept("fused_moe_w8a8",
                   lambda: ops.fused_moe_w8a8(x, gate_up, gu_s, down, dn_s, topk_w, ids, K, True, None),
                   lambda out: assert_close(out, expected, "fused_moe_w8a8", slack=slack))


_NO_CACHE = [("rms_norm", _rms_norm), ("add_rms_norm", _add_rms_norm), ("apply_rotary_pos_emb", _rotary),
             ("silu_and_mul", _silu_and_mul), ("linear", _linear), ("moe_gating_topk_softmax", _moe_gating),
             ("fused_moe", _fused_moe), ("prefill_attention", _prefill), ("dynamic_quant", _dynamic_quant),
             ("linear_w8a8", _linear_w8a8), ("rms_norm_w8a8", partial(_norm_w8a8, op="rms_norm_w8a8")),
             ("add_rms_norm_w8a8", partial(_norm_w8a8, op="add_rms_norm_w8a8")), ("fused_moe_w8a8", _fused_moe_w8a8)]


@suite("strided_last_dim")
def strided_last_dim(layouts):
    checks = [Check("strided_last_dim", op, op, STRIDED, fn, case="inputs", head_dim=64 if "attention" in op else None)
              for op, fn in _NO_CACHE]
    for layout in layouts:
        for what, strided_caches in (("inputs", False), ("caches", True)):
            checks.append(Check("strided_last_dim", params(layout, "fill_kv_cache", what), "fill_kv_cache", STRIDED,
                                partial(_fill, layout=layout, strided_caches=strided_caches), case=what,
                                layout=layout))
            for op in ("paged_prefill_attention", "paged_decode_attention"):
                checks.append(Check("strided_last_dim", params(layout, op, what), op, STRIDED,
                                    partial(_paged, layout=layout, op=op, strided_caches=strided_caches), case=what,
                                    layout=layout, head_dim=64))
    return checks
