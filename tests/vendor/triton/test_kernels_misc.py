"""Kernel-level tests of the triton vendor's non-attention ops (the op parity suite is tests/ops).

What only these kernels can get wrong: cache slots outside the cache (masked, never written),
int64 slot and offset math on caches past 2**31 elements, the on-device expert sort/align of
fused_moe (padding, stability, blocks past the end), the BLOCK_M tile choices, expert ids outside
[0, E), empty key heads, NaN router rows. The vendor functions are called directly (the ops
layer would reject bad values first under DLINFER_CHECK_VALUES=1). References are fp64 math or
plain loops written here. Small shapes: everything runs through TRITON_INTERPRET=1 without a GPU.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

from dlinfer.vendor.triton import kv_cache as KV  # noqa: E402
from dlinfer.vendor.triton import moe as MOE  # noqa: E402
from dlinfer.vendor.triton import rotary as ROT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- the vendor


def test_vendor_declaration():
    from dlinfer.vendor.triton import load

    vendor = load()
    assert vendor.name == "triton" and "cuda" in vendor.device_types
    assert ("cpu" in vendor.device_types) == (os.environ.get("TRITON_INTERPRET") == "1")
    assert vendor.kv_layouts == ("token_major", "head_major")
    assert set(vendor.capabilities.dtypes) == set(DTYPES)
    assert "platform matmul" in vendor.capabilities.notes["linear"]
    for op in ("rms_norm", "add_rms_norm", "apply_rotary_pos_emb", "fill_kv_cache", "moe_gating_topk_softmax",
               "fused_moe", "silu_and_mul", "linear"):
        assert vendor.ops[op].__module__.startswith("dlinfer.vendor.triton."), op


# ---------------------------------------------------------------- fill_kv_cache


def _write_reference(cache, slots, rows, bs, layout):
    """Plain loop: rows[i] into slot slots[i] when the slot is inside the cache."""
    out = cache.clone()
    nb = cache.shape[0]
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < nb * bs:
            b, o = divmod(s, bs)
            if layout == "token_major":
                out[b, o] = rows[i]
            else:
                out[b, :, o] = rows[i]
    return out


@pytest.mark.parametrize("layout", ("token_major", "head_major"))
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))
def test_fill_kv_cache_bad_slots_never_written(layout, index_dtype):
    nb, bs, hkv, d, dv = 3, 4, 2, 16, 24
    g = _gen(1)
    shape = (lambda dd: (nb, bs, hkv, dd)) if layout == "token_major" else (lambda dd: (nb, hkv, bs, dd))
    # the cache sits inside a larger buffer: a stray write past either end would show in the guards
    kbuf = torch.randn(nb + 2, *shape(d)[1:], generator=g).to(DEVICE)
    vbuf = torch.randn(nb + 2, *shape(dv)[1:], generator=g).to(DEVICE)
    kc, vc = kbuf[1:-1], vbuf[1:-1]
    big = 2**31 - 1 if index_dtype == torch.int32 else 2**40
    slots = torch.tensor([-1, 5, nb * bs, big, 0, -(2**20), nb * bs - 1], dtype=index_dtype, device=DEVICE)
    key = torch.randn(len(slots), hkv, d, generator=g).to(DEVICE)
    value = torch.randn(len(slots), hkv, dv, generator=g).to(DEVICE)
    exp_k = _write_reference(kc.cpu(), slots.cpu(), key.cpu(), bs, layout)
    exp_v = _write_reference(vc.cpu(), slots.cpu(), value.cpu(), bs, layout)
    kguard, vguard = kbuf[[0, -1]].clone(), vbuf[[0, -1]].clone()
    KV.fill_kv_cache(key, value, kc, vc, slots, layout)
    assert torch.equal(kc.cpu(), exp_k) and torch.equal(vc.cpu(), exp_v)
    assert torch.equal(kbuf[[0, -1]], kguard) and torch.equal(vbuf[[0, -1]], vguard)


def test_fill_kv_cache_int64_slots_on_zero_stride_cache():
    """NB * BS > 2**32 slots without the memory: every block aliases one (block stride 0).
    Slot 2**31 + 7 is valid and lands at offset 7; int32 slot math would drop it as negative."""
    bs, hkv, d = 16, 2, 8
    nb = 2**29  # nb * bs = 2**33
    kc = torch.zeros(1, bs, hkv, d, device=DEVICE).expand(nb, bs, hkv, d)
    vc = torch.zeros(1, bs, hkv, d, device=DEVICE).expand(nb, bs, hkv, d)
    slots = torch.tensor([2**31 + 7, nb * bs, 2**32 + bs - 1, nb * bs + 3], dtype=torch.int64, device=DEVICE)
    key = torch.arange(1, 1 + 4 * hkv * d, dtype=torch.float32, device=DEVICE).view(4, hkv, d)
    KV.fill_kv_cache(key, -key, kc, vc, slots, "token_major")
    base = kc[0]
    assert torch.equal(base[7], key[0]) and torch.equal(vc[0, 7], -key[0])
    assert torch.equal(base[bs - 1], key[2])
    others = [o for o in range(bs) if o not in (7, bs - 1)]
    assert not base[others].any(), "a slot past NB*BS was written"


def test_fill_kv_cache_many_blocks_small_d():
    """40k blocks, head dim 4: slots spread over the whole cache, both layouts."""
    nb, bs, hkv, d = 40000, 16, 1, 4
    g = _gen(2)
    for layout in ("token_major", "head_major"):
        shape = (nb, bs, hkv, d) if layout == "token_major" else (nb, hkv, bs, d)
        kc = torch.zeros(shape, dtype=torch.float16, device=DEVICE)
        vc = torch.zeros(shape, dtype=torch.float16, device=DEVICE)
        slots = torch.cat((torch.randperm(nb * bs, generator=g)[:30], torch.tensor([nb * bs - 1, 0])))
        key = torch.randn(len(slots), hkv, d, generator=g).half()
        exp = _write_reference(kc.cpu(), slots, key, bs, layout)
        KV.fill_kv_cache(key.to(DEVICE), key.to(DEVICE), kc, vc, slots.int().to(DEVICE), layout)
        assert torch.equal(kc.cpu(), exp) and torch.equal(vc.cpu(), exp)


_INT64_CHECK = r"""
import torch
from dlinfer.vendor.triton.kv_cache import fill_kv_cache
dev = "cuda" if torch.cuda.is_available() else "cpu"
nb, bs, h, d = 2**14 + 1, 64, 16, 128  # 2**31 + 2**17 elements: block * block_stride needs int64
for layout in ("token_major", "head_major"):
    shape = (nb, bs, h, d) if layout == "token_major" else (nb, h, bs, d)
    kc = torch.empty(shape, dtype=torch.float16, device=dev)  # untouched pages cost no memory on CPU
    vc = torch.empty(shape[:3] + (1,), dtype=torch.float16, device=dev)  # Dv = 1
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, h, d, generator=g).half().to(dev)
    v = torch.randn(3, h, 1, generator=g).half().to(dev)
    for idx_dtype in (torch.int32, torch.int64):
        slots = torch.tensor([(nb - 1) * bs + 5, 3, (nb - 2) * bs + bs - 1], dtype=idx_dtype, device=dev)
        fill_kv_cache(k, v, kc, vc, slots, layout)
        for i, s in enumerate(slots.tolist()):
            b, o = divmod(s, bs)
            kgot, vgot = (kc[b, o], vc[b, o]) if layout == "token_major" else (kc[b, :, o], vc[b, :, o])
            assert torch.equal(kgot, k[i]) and torch.equal(vgot, v[i]), (layout, idx_dtype, i)
print("ok")
"""


def test_fill_kv_cache_int64_offsets():
    """A 2**31+ element cache written at its last blocks, both layouts and index dtypes. In a
    subprocess: with int32 offsets the interpreter segfaults rather than failing an assert."""
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "0"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _INT64_CHECK], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-2000:], r.stderr[-4000:])


# ---------------------------------------------------------------- rotary


def test_rotary_no_key_heads_and_no_tokens():
    g = _gen(3)
    q = torch.randn(3, 5, 64, generator=g).to(DEVICE)
    k = torch.zeros(3, 0, 64, device=DEVICE)
    cos, sin = torch.randn(3, 32, generator=g).to(DEVICE), torch.randn(3, 32, generator=g).to(DEVICE)
    qo, ko = ROT.apply_rotary_pos_emb(q, k, cos, sin)
    assert ko.shape == (3, 0, 64)
    c, s = cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    x = q.double().cpu()
    ref = torch.cat((x[..., :16] * c[..., :16] - x[..., 16:32] * s[..., :16],
                     x[..., 16:32] * c[..., 16:] + x[..., :16] * s[..., 16:], x[..., 32:]), -1)
    assert (qo.double().cpu() - ref).abs().max() < 1e-5
    qo, ko = ROT.apply_rotary_pos_emb(q[:0], k[:0], cos[:0], sin[:0])
    assert qo.shape == (0, 5, 64) and ko.shape == (0, 0, 64)


# ---------------------------------------------------------------- MoE router


def test_gating_nan_row_keeps_ids_in_range():
    logits = torch.tensor([[0.0, float("nan"), 1.0, 2.0, 0.5], [3.0, 1.0, 2.0, 0.0, 4.0]], device=DEVICE)
    w, ids = MOE.moe_gating_topk_softmax(logits, 3)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 5
    assert ids[1].tolist() == [4, 0, 2]


# ---------------------------------------------------------------- fused_moe: sort / align


def _check_align(ids, num_experts, block_m):
    """The contract of moe_align, checked against plain loops."""
    sorted_ids, block_expert = MOE.moe_align(ids, num_experts, block_m)
    sorted_ids, block_expert = sorted_ids.cpu().tolist(), block_expert.cpu().tolist()
    flat = ids.reshape(-1).cpu().tolist()
    n_pairs = len(flat)
    assert len(sorted_ids) == len(block_expert) * block_m
    assert len(block_expert) * block_m >= n_pairs + num_experts * (block_m - 1) - (block_m - 1)
    pos = 0
    for e in range(num_experts):
        mine = [p for p, x in enumerate(flat) if x == e]  # stable: pair order within an expert
        n_blk = -(-len(mine) // block_m)
        seg = sorted_ids[pos: pos + n_blk * block_m]
        assert seg[: len(mine)] == mine, f"expert {e}: {seg[:len(mine)]} != {mine}"
        assert all(s == n_pairs for s in seg[len(mine):]), f"expert {e}: padding {seg[len(mine):]}"
        assert block_expert[pos // block_m: pos // block_m + n_blk] == [e] * n_blk
        pos += n_blk * block_m
    assert all(b == num_experts for b in block_expert[pos // block_m:]), block_expert
    assert all(s == n_pairs for s in sorted_ids[pos:])


@pytest.mark.parametrize("block_m", (16, 64))
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64))
def test_moe_align(block_m, index_dtype):
    g = _gen(4)
    cases = [
        torch.randint(0, 8, (7, 2), generator=g),          # E=8, K=2
        torch.randint(0, 5, (9, 3), generator=g),          # E=5, K=3
        torch.zeros(1, 2, dtype=torch.long),               # T=1, one expert only
        torch.full((40, 2), 3),                            # everything to the last expert
        torch.randint(0, 64, (300, 2), generator=g),       # more pairs than one chunk (E=64)
        torch.tensor([[-1, 2], [4, 1], [5, 9]]),           # ids outside [0, 5) are dropped
    ]
    experts = [8, 5, 3, 4, 64, 5]
    for ids, num_experts in zip(cases, experts):
        _check_align(ids.to(dtype=index_dtype, device=DEVICE), num_experts, block_m)


# ---------------------------------------------------------------- fused_moe: tile rules, bad ids


def _moe_reference(x, gate_up, down, w, ids, renorm):
    inter = gate_up.shape[1] // 2
    w = w.double().cpu()
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    x, gate_up, down = x.double().cpu(), gate_up.double().cpu(), down.double().cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up.shape[0]:
                continue
            a = gate_up[e] @ x[t]
            out[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(a[:inter]) * a[inter:]))
    return out


@pytest.mark.parametrize("tokens,experts,topk,block_m", [(7, 8, 2, 16), (40, 2, 2, 32), (60, 2, 2, 64)],
                         ids=["bm16", "bm32", "bm64"])
def test_fused_moe_tile_sizes(tokens, experts, topk, block_m):
    """Each BLOCK_M of the tile rule (16, 32, 64 pairs per row block), H and I not multiples of 16."""
    g = _gen(5)
    h, inter = 40, 24
    x = torch.randn(tokens, h, generator=g).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, h, generator=g) * h**-0.5).to(DEVICE)
    down = (torch.randn(experts, h, inter, generator=g) * inter**-0.5).to(DEVICE)
    w, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), topk, -1)
    assert MOE._tiles(tokens * topk, experts, torch.float32)[0] == block_m
    out = MOE.fused_moe(x, gate_up, down, w.to(DEVICE), ids.to(DEVICE), True)
    err = (out.double().cpu() - _moe_reference(x, gate_up, down, w, ids, True)).abs().max().item()
    assert err < 32 * 2.0**-23 * 4, err


def test_fused_moe_128_row_tiles_in_half_precision(monkeypatch):
    """On sm_90 on, from 256 (token, expert) pairs an expert, bfloat16 / float16 take 128-row tiles
    (float32 and older GPUs keep 64): the 128-row blocks, their padding and the expert boundaries
    inside them, against the float64 reference (inputs rounded to bf16 first; fp32 dots)."""
    g = _gen(7)
    tokens, experts, topk, h, inter = 300, 2, 2, 40, 24  # 300 pairs an expert: two blocks of 128, one partial
    assert MOE._tiles(tokens * topk, experts, torch.bfloat16, wide=True)[0] == 128
    assert MOE._tiles(tokens * topk, experts, torch.bfloat16, wide=False)[0] == 64
    assert MOE._tiles(tokens * topk, experts, torch.float32, wide=True)[0] == 64
    monkeypatch.setattr(MOE, "hopper", lambda device: True)
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(experts, 2 * inter, h, generator=g) * h**-0.5).to(torch.bfloat16)
    down = (torch.randn(experts, h, inter, generator=g) * inter**-0.5).to(torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), topk, -1)
    out = MOE.fused_moe(x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), True)
    ref = _moe_reference(x.double(), gate_up.double(), down.double(), w, ids, True)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err < 2 * 2.0**-8 * ref.abs().max().item(), err  # the activation's and output's bf16 roundings


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_fused_moe_ids_outside_experts_count_as_zero(dtype):
    g = _gen(6)
    t, h, inter, experts = 4, 32, 16, 3
    x = torch.randn(t, h, generator=g).to(dtype=dtype, device=DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, h, generator=g) * h**-0.5).to(dtype=dtype, device=DEVICE)
    down = (torch.randn(experts, h, inter, generator=g) * inter**-0.5).to(dtype=dtype, device=DEVICE)
    ids = torch.tensor([[0, -1], [3, 2], [1, 1], [7, -5]], device=DEVICE)
    w = torch.rand(t, 2, generator=g).to(DEVICE)
    out = MOE.fused_moe(x, gate_up, down, w, ids, False)
    ref = _moe_reference(x, gate_up, down, w, ids, False)
    assert not out[3].any()
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert (out.double().cpu() - ref).abs().max().item() < tol


@pytest.mark.parametrize("capability, hip, wide", [
    ((9, 0), None, True), ((10, 0), None, True),  # H100 / H200, B200: ~227 KB of shared memory a block
    ((8, 0), None, False), ((8, 9), None, False), ((12, 0), None, False),  # A100, Ada, consumer Blackwell
    ((9, 4), "6.2", False),  # an MI300 reports major 9 through ROCm
])
def test_the_wide_tiles_go_to_sm90_and_sm100_alone(capability, hip, wide, monkeypatch):
    from dlinfer.vendor.triton._common import hopper

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert hopper.__wrapped__(torch.device("cuda", 0)) is wide
    assert hopper.__wrapped__(torch.device("cpu")) is False
