"""LMDeploy's own `lmdeploy.pytorch.kernels.dlinfer` functions on CPU, against float64 references.

These are the exact calls LMDeploy's dlinfer layers make (positional order, keywords, return
values). Attention metadata comes from the CPU backend's `update_step_context`, caches are in
the active vendor's layout, and every reference is written here as dense per-sequence float64
math, independent of dlinfer's code. Every test runs under each CPU vendor (torch, cpu).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from lmdeploy.pytorch.kernels import dlinfer as kernels
from lmdeploy.pytorch.kernels.dlinfer.activation import silu_and_mul

import dlinfer.framework.lmdeploy_ext  # noqa: F401
import dlinfer.vendor
from dlinfer.framework.lmdeploy_ext.backend.op_backend import CpuOpsBackend

CPU_VENDORS = [v for v in ("torch", "cpu") if v in dlinfer.vendor.available()]


@pytest.fixture(params=CPU_VENDORS, autouse=True)
def vendor(request):
    """The vendor every call of the test runs on."""
    with dlinfer.vendor.using(request.param):
        yield request.param


# (atol, rtol) of a result in `dtype` against the float64 reference.
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- paged attention ----------


def _make_batch(q_lens, history, hq, hkv, d, block_size, dtype, layout, is_decoding, seed):
    """Random K/V for every position of every sequence, scattered into a paged cache through
    LMDeploy's fill_kv_cache (history first, then the new tokens as the engine would)."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [q + h for q, h in zip(q_lens, history)]
    max_blocks = max((kv + block_size - 1) // block_size for kv in kv_lens)
    num_blocks = max_blocks * len(q_lens) + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    table = torch.tensor([order[b * max_blocks:(b + 1) * max_blocks] for b in range(len(q_lens))])
    keys = [torch.randn(kv, hkv, d, generator=g).to(dtype) for kv in kv_lens]
    values = [torch.randn(kv, hkv, d, generator=g).to(dtype) for kv in kv_lens]
    query = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    shape = (num_blocks, block_size, hkv, d) if layout == "token_major" else (num_blocks, hkv, block_size, d)
    # Unwritten slots hold large garbage: attending to one of them would change the result.
    k_cache = (1e3 * torch.randn(shape, generator=g)).to(dtype)
    v_cache = (1e3 * torch.randn(shape, generator=g)).to(dtype)

    def slots(b, positions):
        return torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size for p in positions],
                            dtype=torch.long)

    hist_idx = torch.cat([slots(b, range(h)) for b, h in enumerate(history)])
    if hist_idx.numel():
        kernels.fill_kv_cache(torch.cat([k[:h] for k, h in zip(keys, history)]),
                              torch.cat([v[:h] for v, h in zip(values, history)]),
                              k_cache, v_cache, hist_idx, k_scales_zeros=[], v_scales_zeros=[], quant_bits=0)
    ctx = SimpleNamespace(
        input_ids=torch.zeros(1, sum(q_lens), dtype=torch.long), q_seqlens=torch.tensor(q_lens),
        kv_seqlens=torch.tensor(kv_lens), block_offsets=table, is_decoding=is_decoding,
        max_q_seqlen=max(q_lens), max_kv_seqlen=max(kv_lens), sum_kv_seqlen=sum(kv_lens),
        kv_quant_policy=0, cache_config=SimpleNamespace(kernel_block_size=block_size))
    meta = CpuOpsBackend.update_step_context(ctx).attn_metadata
    new_k = torch.cat([k[h:] for k, h in zip(keys, history)])
    new_v = torch.cat([v[h:] for v, h in zip(values, history)])
    return SimpleNamespace(query=query, new_k=new_k, new_v=new_v, keys=keys, values=values, k_cache=k_cache,
                           v_cache=v_cache, meta=meta)


def _reference_attention(query, keys, values, q_lens, history, scale):
    """Dense causal attention per sequence in float64: [T, Hq, D]."""
    out, start = [], 0
    for k, v, q_len, h in zip(keys, values, q_lens, history):
        q = query[start:start + q_len].double()
        start += q_len
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [kv, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        positions = torch.arange(h, h + q_len)[:, None]
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(out)


CASES = [  # (q_lens, history, is_decoding): which wrapper path LMDeploy takes
    ([9, 1, 23], [0, 0, 0], False),      # prefill_attention (no history)
    ([9, 4, 17], [16, 3, 40], False),    # paged_prefill_attention (prefix hit / later chunk)
    ([1, 1, 1, 1], [0, 15, 16, 70], True),  # paged_decode_attention
]


def _run_paged_attention(q_lens, history, is_decoding, dtype, layout):
    """LMDeploy's paged_attention_fwd on one batch; (output, query buffer after, float64 reference)."""
    hq, hkv, d, block_size = 4, 2, 32, 16
    with dlinfer.vendor.using(dlinfer.vendor.vendor_name, kv_layout=layout):
        b = _make_batch(q_lens, history, hq, hkv, d, block_size, dtype, layout, is_decoding, seed=len(q_lens))
        meta = b.meta
        kernels.fill_kv_cache(b.new_k, b.new_v, b.k_cache, b.v_cache, meta.kv_start_indices,
                              k_scales_zeros=[], v_scales_zeros=[], quant_bits=0)
        query = b.query.clone()
        attn_output = query[..., :d]  # what DlinferAttentionImpl passes
        out = kernels.paged_attention_fwd(
            query, b.new_k, b.new_v, attn_output, b.k_cache, b.v_cache, meta.block_offsets,
            q_seqlens=meta.q_seqlens, kv_seqlens=meta.kv_seqlens, max_q_seq_len=meta.max_q_seqlen,
            max_kv_seq_len=meta.max_kv_seq_len, is_decoding=meta.is_decoding, block_size=block_size,
            num_heads=hq, num_kv_heads=hkv, v_head_size=d, attn_mask=meta.attention_mask,
            softmax_scale=d ** -0.5, is_prefill_no_cache=meta.is_prefill_no_cache, kv_scales=None,
            kv_zeros=None, quant_bits=0, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_q_cpu=meta.cu_seqlens_q_cpu,
            kv_seqlens_cpu=meta.kv_seqlens_cpu)
    return out, query[..., :d], _reference_attention(b.query, b.keys, b.values, q_lens, history, d ** -0.5)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,history,is_decoding", CASES)
def test_paged_attention_fwd(q_lens, history, is_decoding, dtype, layout):
    out, query_after, expected = _run_paged_attention(q_lens, history, is_decoding, dtype, layout)
    _close(out, expected, dtype)
    _close(query_after, expected, dtype)  # written in place into the query buffer


@pytest.mark.parametrize("q_lens,history,is_decoding", [
    ([13, 7, 30], [700, 900, 1100], False),
    ([1, 1, 1, 1], [700, 900, 1100, 1300], True),
])
def test_paged_attention_fwd_inside_then_outside_inference_mode(q_lens, history, is_decoding):
    """LMDeploy runs every forward under torch.inference_mode(); the same process may later call
    the ops without it (another engine, a test, a script). Longer sequences than elsewhere in this
    file, so that any buffer an op keeps between calls is first allocated in inference mode."""
    with torch.inference_mode():
        out, _, expected = _run_paged_attention(q_lens, history, is_decoding, torch.float32, "token_major")
    _close(out, expected, torch.float32)
    out, _, expected = _run_paged_attention(q_lens, history, is_decoding, torch.float32, "token_major")
    _close(out, expected, torch.float32)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_fill_kv_cache_writes_exact_slots(layout):
    with dlinfer.vendor.using(dlinfer.vendor.vendor_name, kv_layout=layout):
        b = _make_batch([5, 12], [3, 20], 4, 2, 16, 8, torch.float32, layout, False, seed=7)
        k_cache, v_cache = kernels.fill_kv_cache(b.new_k, b.new_v, b.k_cache, b.v_cache, b.meta.kv_start_indices,
                                                 k_scales_zeros=[], v_scales_zeros=[], quant_bits=0)
    assert k_cache is b.k_cache and v_cache is b.v_cache
    for t, slot in enumerate(b.meta.kv_start_indices.tolist()):
        block, offset = divmod(slot, 8)
        got_k = k_cache[block, offset] if layout == "token_major" else k_cache[block, :, offset]
        got_v = v_cache[block, offset] if layout == "token_major" else v_cache[block, :, offset]
        assert torch.equal(got_k, b.new_k[t]) and torch.equal(got_v, b.new_v[t])


# ---------------------------------------------------------------- dense ops ----------------


def _rms_norm_ref(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g).to(dtype)
    residual = torch.randn(7, 64, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    _close(kernels.rms_norm(x, w, 1e-6), _rms_norm_ref(x, w, 1e-6), dtype)
    out, new_residual = kernels.rms_norm(x, w, 1e-6, residual=residual)
    summed = x + residual  # the sum is taken in the activation dtype
    assert torch.equal(new_residual, summed)
    _close(out, _rms_norm_ref(summed, w, 1e-6), dtype)


def test_apply_rotary_pos_emb_lmdeploy_cos_sin():
    """cos/sin as LMDeploy's dlinfer rotary embedding makes them ([1, T, D] halves duplicated)."""
    from lmdeploy.pytorch.backends.dlinfer.rotary_embedding import DlinferRotaryEmbeddingImpl

    t, hq, hkv, d = 6, 4, 2, 32
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    positions = torch.tensor([[0, 1, 2, 7, 8, 30]])
    cos, sin = DlinferRotaryEmbeddingImpl(d, base=10000)(q, positions)
    q_out, k_out = kernels.apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin, None, None)

    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = positions[0].double()[:, None] * inv_freq[None, :]
    c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rotate(x):
        x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    _close(q_out, rotate(q), torch.float32)
    _close(k_out, rotate(k), torch.float32)


def test_silu_and_mul_and_linear():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2 * 48, generator=g)
    gate, up = x.double()[:, :48], x.double()[:, 48:]
    _close(silu_and_mul(x), gate * torch.sigmoid(gate) * up, torch.float32)
    w, bias = torch.randn(24, 96, generator=g) * 0.1, torch.randn(24, generator=g)
    _close(kernels.linear(x, w, bias, False), x.double() @ w.double().T + bias.double(), torch.float32)
    _close(kernels.linear(x, w), x.double() @ w.double().T, torch.float32)


# ---------------------------------------------------------------- MoE ----------------------


def test_moe_gating_topk_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(11, 8, generator=g)
    weights, ids = kernels.moe_gating_topk_softmax(logits, 2, None)
    probs = logits.double().softmax(-1)
    expected_ids = [sorted(range(8), key=lambda e: (-probs[t, e].item(), e))[:2] for t in range(11)]
    assert ids.dtype == torch.int64 and ids.tolist() == expected_ids
    assert weights.dtype == torch.float32
    _close(weights, torch.stack([probs[t, expected_ids[t]] for t in range(11)]), torch.float32)


@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_moe(renormalize):
    t, h, inter, experts, topk = 9, 32, 24, 4, 2
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, h, generator=g)
    gate_up = torch.randn(experts, 2 * inter, h, generator=g) * 0.2
    down = torch.randn(experts, h, inter, generator=g) * 0.2
    weights, ids = kernels.moe_gating_topk_softmax(torch.randn(t, experts, generator=g), topk, None)
    out = kernels.fused_moe(x, gate_up, down, weights, ids, topk, renormalize, None)

    expected = torch.zeros(t, h, dtype=torch.float64)
    for i in range(t):
        w = weights[i].double()
        if renormalize:
            w = w / w.sum()
        for j in range(topk):
            e = int(ids[i, j])
            a = gate_up[e].double() @ x[i].double()
            hidden = torch.nn.functional.silu(a[:inter]) * a[inter:]
            expected[i] += w[j] * (down[e].double() @ hidden)
    _close(out, expected, torch.float32)
