"""Graph mode with the int8 KV cache: a quantised fill + paged decode + paged prefill compile
(fullgraph) to one dlinfer node each, and the compiled step writes the same int8 bytes and gives
the same outputs as eager."""

import torch

import dlinfer.ops as ops
import dlinfer.vendor

from .helpers import capture, dl_counts

HKV, HQ, D, BS, NB = 2, 4, 64, 8, 6


def _step(q, k, v, kc, vc, slots, bt, q_ends, kv_lens, ks, kz, vs, vz):
    ops.fill_kv_cache(k, v, kc, vc, slots, k_scales_zeros=[ks, kz], v_scales_zeros=[vs, vz], quant_bits=8)
    kv_scales, kv_zeros = torch.stack([ks, vs]), torch.stack([kz, vz])
    dec = ops.paged_decode_attention(q, kc, vc, bt, BS, q_ends, kv_lens, 16, HQ, HKV, head_size_v=D,
                                     kv_scales=kv_scales, kv_zeros=kv_zeros, quant_bits=8)
    pre = ops.paged_prefill_attention(q, None, None, kc, vc, bt, BS, q_ends, kv_lens, 1, 16, HQ, HKV, [],
                                      head_size_v=D, kv_scales=kv_scales, kv_zeros=kv_zeros, quant_bits=8)
    return dec, pre


def _inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, HQ, D, generator=g)
    k, v = torch.randn(2, HKV, D, generator=g), torch.randn(2, HKV, D, generator=g)
    kc = torch.randint(-128, 128, (NB, BS, HKV, D), generator=g).to(torch.int8)
    vc = torch.randint(-128, 128, (NB, BS, HKV, D), generator=g).to(torch.int8)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q_ends, kv_lens = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([12, 16], dtype=torch.int32)
    slots = torch.tensor([11, 3 * BS + 7])
    quant = [torch.tensor(x) for x in ([0.02, 0.03], [0.0, 1.0], [0.04, 0.05], [-1.5, 0.0])]
    return [q, k, v, kc, vc, slots, bt, q_ends, kv_lens, *quant]


def test_int8_kv_ops_are_one_node_each_and_match_eager():
    with dlinfer.vendor.using("torch"):
        gm, _ = capture(_step, *_inputs())
        assert dl_counts(gm) == {"fill_kv_cache": 1, "paged_decode_attention": 1, "paged_prefill_attention": 1}
        eager_in, compiled_in = _inputs(), _inputs()
        with torch.inference_mode():
            want = _step(*eager_in)
            got = torch.compile(_step, backend="dlinfer", fullgraph=True)(*compiled_in)
    assert torch.equal(compiled_in[3], eager_in[3]) and torch.equal(compiled_in[4], eager_in[4])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
