"""rotary pass: before/after graphs on HF's rotate_half + apply_rotary_pos_emb in several layouts."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb

from .helpers import assert_same, capture, count, dl_counts, rewrite, run_graph

D = 16


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tables(*lead, dtype=torch.float32):
    angle = _rand(*lead, D // 2, seed=9)
    return torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)


def _check(fn, *args, atol=0.0, rtol=0.0):
    gm, inputs = capture(fn, *args)
    before = run_graph(gm, inputs)
    counts = rewrite(gm, "rotary")
    after = run_graph(gm, inputs)
    assert_same(after, before, atol=atol, rtol=rtol)
    return gm, counts


def test_hf_llama_layout_query_and_key_one_call():
    """HF: q [B, Hq, S, D], k [B, Hkv, S, D], cos [B, S, D] unsqueezed at dim 1."""
    q, k = _rand(2, 4, 5, D), _rand(2, 2, 5, D, seed=1)
    cos, sin = _tables(2, 5)
    gm, counts = _check(hf_apply_rotary_pos_emb, q, k, cos, sin)
    assert counts == {"rotary": 2}
    assert dl_counts(gm) == {"apply_rotary_pos_emb": 1}  # query and key share one call
    assert count(gm, "cat") == 0 and count(gm, "neg") == 0


def test_hf_transposed_views():
    """As in LlamaAttention: the projections are viewed [B, S, H, D] and transposed."""
    q = _rand(2, 5, 4 * D).view(2, 5, 4, D).transpose(1, 2)
    k = _rand(2, 5, 2 * D, seed=1).view(2, 5, 2, D).transpose(1, 2)
    cos, sin = _tables(2, 5)
    gm, counts = _check(lambda q, k, c, s: hf_apply_rotary_pos_emb(q, k, c, s), q, k, cos, sin)
    assert counts == {"rotary": 2} and dl_counts(gm) == {"apply_rotary_pos_emb": 1}


def test_batch_broadcast_tables():
    """cos [1, S, D] (one set of positions for every sequence): the batch acts like a head dim."""
    q, k = _rand(3, 4, 5, D), _rand(3, 2, 5, D, seed=1)
    cos, sin = _tables(1, 5)
    gm, counts = _check(hf_apply_rotary_pos_emb, q, k, cos, sin)
    assert counts == {"rotary": 2} and dl_counts(gm) == {"apply_rotary_pos_emb": 1}


def test_token_major_layout():
    """LMDeploy-like: q [T, Hq, D], cos [T, D] unsqueezed to [T, 1, D]."""
    q, k = _rand(7, 4, D), _rand(7, 2, D, seed=1)
    cos, sin = _tables(7)
    gm, counts = _check(hf_apply_rotary_pos_emb, q, k, cos, sin)
    assert counts == {"rotary": 2} and dl_counts(gm) == {"apply_rotary_pos_emb": 1}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    """The fused op rotates in float32: at least as accurate as the unfused half-precision graph."""
    q, k = _rand(2, 4, 5, D, dtype=dtype), _rand(2, 2, 5, D, seed=1, dtype=dtype)
    cos, sin = _tables(2, 5, dtype=dtype)
    _check(hf_apply_rotary_pos_emb, q, k, cos, sin, atol=1e-2, rtol=1e-2)


def test_chunk_spelling_and_single_tensor():
    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def f(q, cos, sin):
        return sin * rotate(q) + q * cos  # operands swapped, one tensor only

    q = _rand(6, 3, D)
    cos, sin = _tables(6)
    gm, counts = _check(f, q, cos[:, None], sin[:, None])
    assert counts == {"rotary": 1} and dl_counts(gm) == {"apply_rotary_pos_emb": 1}


@pytest.mark.parametrize("case", ["interleaved", "wrong_order", "promotes_dtype", "half_used_elsewhere",
                                  "table_written_in_place"])
def test_not_rewritten(case):
    q = _rand(5, 4, D)
    cos, sin = _tables(5)
    if case != "table_written_in_place":
        cos, sin = cos[:, None], sin[:, None]
    if case == "interleaved":  # GPT-J style rotate_every_two: another op
        def f(q, c, s):
            rot = torch.stack((-q[..., 1::2], q[..., ::2]), -1).flatten(-2)
            return q * c + rot * s
    elif case == "wrong_order":  # cat((x1, -x2)) is not rotate_half
        def f(q, c, s):
            return q * c + torch.cat((q[..., : D // 2], -q[..., D // 2:]), -1) * s
    elif case == "promotes_dtype":  # bf16 q with fp32 tables: the unfused result is fp32
        q = q.bfloat16()
        f = lambda q, c, s: hf_apply_rotary_pos_emb(q, q, c, s, unsqueeze_dim=0)[0]  # noqa: E731
    elif case == "half_used_elsewhere":
        def f(q, c, s):
            x2 = q[..., D // 2:]
            return q * c + torch.cat((-x2, q[..., : D // 2]), -1) * s, x2
    else:
        def f(q, c, s):
            c = c * 1.0
            cu, su = c[:, None], s[:, None]
            c.mul_(0.5)  # writes cu too: a rewrite placed after its inputs would read it unwritten
            return q * cu + torch.cat((-q[..., D // 2:], q[..., : D // 2]), -1) * su
    gm, counts = _check(f, q, cos, sin)
    assert counts == {"rotary": 0} and dl_counts(gm) == {}, gm.code
