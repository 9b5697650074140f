"""The attention metadata `update_step_context` builds, against slots computed by plain loops."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import dlinfer.framework.lmdeploy_ext  # noqa: F401
from dlinfer.framework.lmdeploy_ext.backend.op_backend import CpuOpsBackend


def _step_context(q_lens, history, block_size, num_blocks=64, is_decoding=False, seed=0):
    """A StepContext-like namespace: random distinct physical blocks per sequence."""
    rng = random.Random(seed)
    kv_lens = [q + h for q, h in zip(q_lens, history)]
    max_blocks = max((kv + block_size - 1) // block_size for kv in kv_lens)
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    table = [[pool.pop() for _ in range(max_blocks)] for _ in q_lens]
    return SimpleNamespace(
        input_ids=torch.zeros(1, sum(q_lens), dtype=torch.long),
        q_seqlens=torch.tensor(q_lens),
        kv_seqlens=torch.tensor(kv_lens),
        block_offsets=torch.tensor(table),
        is_decoding=is_decoding,
        max_q_seqlen=max(q_lens),
        max_kv_seqlen=max(kv_lens),
        sum_kv_seqlen=sum(kv_lens),
        kv_quant_policy=0,
        cache_config=SimpleNamespace(kernel_block_size=block_size),
    ), table


def _reference_slots(q_lens, history, table, block_size):
    slots = []
    for b, (q, h) in enumerate(zip(q_lens, history)):
        for pos in range(h, h + q):
            slots.append(table[b][pos // block_size] * block_size + pos % block_size)
    return slots


@pytest.mark.parametrize("q_lens,history", [
    ([5, 17, 1], [0, 0, 0]),           # prefill, no history
    ([7, 16, 33], [16, 0, 5]),         # prefill with history (prefix-cache hit / later chunk)
    ([32], [48]),                      # one long chunk, history crossing blocks
])
def test_prefill_metadata(q_lens, history):
    block_size = 16
    ctx, table = _step_context(q_lens, history, block_size)
    meta = CpuOpsBackend.update_step_context(ctx).attn_metadata
    assert meta.kv_start_indices.tolist() == _reference_slots(q_lens, history, table, block_size)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    assert meta.cu_seqlens_q.tolist() == cu and meta.cu_seqlens_q_cpu.tolist() == cu
    assert meta.kv_seqlens_cpu.tolist() == [q + h for q, h in zip(q_lens, history)]
    assert meta.is_prefill_no_cache == all(h == 0 for h in history)
    assert not meta.is_decoding
    assert meta.block_size == block_size
    assert meta.max_q_seqlen == max(q_lens)
    assert meta.max_kv_seq_len == max(q + h for q, h in zip(q_lens, history))
    assert meta.kv_flatten_size == sum(q_lens) + sum(history)
    assert meta.kv_seqlens_cpu.device.type == "cpu" and meta.cu_seqlens_q_cpu.device.type == "cpu"


def test_decode_metadata():
    block_size = 16
    history = [0, 15, 16, 40, 63]
    q_lens = [1] * len(history)
    ctx, table = _step_context(q_lens, history, block_size, is_decoding=True)
    meta = CpuOpsBackend.update_step_context(ctx).attn_metadata
    assert meta.is_decoding and meta.is_prefill_no_cache is False
    assert meta.kv_start_indices.tolist() == _reference_slots(q_lens, history, table, block_size)
    assert meta.cu_seqlens_q_cpu[1:].tolist() == list(range(1, len(history) + 1))


def test_multi_token_decode_is_refused():
    ctx, _ = _step_context([2, 2], [10, 20], 16, is_decoding=True)
    with pytest.raises(NotImplementedError, match="one token per sequence"):
        CpuOpsBackend.update_step_context(ctx)


def test_block_shapes_follow_vendor_layout():
    import dlinfer.vendor

    with dlinfer.vendor.using("torch", kv_layout="token_major"):
        assert CpuOpsBackend.get_k_block_shape(16, 2, 32, torch.float32) == (16, 2, 32)
        assert CpuOpsBackend.get_v_block_shape(16, 2, 24, torch.float32) == (16, 2, 24)
    if "head_major" in dlinfer.vendor.load("torch").kv_layouts:
        with dlinfer.vendor.using("torch", kv_layout="head_major"):
            assert CpuOpsBackend.get_k_block_shape(16, 2, 32, torch.float32) == (2, 16, 32)
