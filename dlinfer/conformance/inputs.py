"""Inputs of the conformance checks: the device they are made on, seeded generators, and the
adversarial layouts the ops must accept (LMDeploy's packed q/k/v views, paged caches with
shuffled blocks and garbage past each sequence's last block, caches fenced by NaN sentinels).

Every input is a pure function of its seed on a given machine (drawn on the CPU, normal values in
float32, then scaled in float64, cast and moved), so a reference computed once serves every vendor,
layout and device. Two CPUs may draw slightly different values from one seed: torch's float32
normal sampler takes vector approximations of log and cos on AVX2 builds.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from dlinfer.conformance.reference import slot_rows

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("token_major", "head_major")

_device: Optional[torch.device] = None  # None: cuda when present, else cpu


def device() -> torch.device:
    """The device the checks make their tensors on (`on_device` changes it)."""
    if _device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _device


_current_device = device


@contextlib.contextmanager
def on_device(dev):
    global _device
    saved = _device
    _device = torch.device(dev)
    try:
        yield
    finally:
        _device = saved


@contextlib.contextmanager
def value_checks(enabled: bool):
    """dlinfer.ops' value checks on or off inside the block, the previous setting restored after."""
    import dlinfer.ops as ops
    from dlinfer.ops import _checks

    saved = _checks._check_values
    ops.set_value_checks(enabled)
    try:
        yield
    finally:
        ops.set_value_checks(saved)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def gen(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def seed_of(*parts):
    """A stable seed from a check's parameters (hash() of str is salted per process)."""
    s = 0
    for ch in "|".join(str(p) for p in parts):
        s = (s * 131 + ord(ch)) % (2**31 - 1)
    return s


_MEMO: dict = {}


def memo(key, fn):
    """Compute an fp64 reference once per key (inputs are a pure function of their seed, so a check
    that runs under several vendors / layouts / options shares one reference)."""
    if key not in _MEMO:
        _MEMO[key] = fn()
    return _MEMO[key]


def clear_memo() -> None:
    _MEMO.clear()


def randn(shape, dtype, g, scale=1.0, device=None):
    """Normal values (float32 draws, x scale in float64) in dtype on the device. Drawn in float32:
    torch's float64 normal sampler is scalar code, 4x the time of its float32 one, and it was a
    quarter of the conformance suite's time on CPU."""
    dev = _current_device() if device is None else device
    return (torch.randn(shape, generator=g, dtype=torch.float32).double() * scale).to(dtype=dtype, device=dev)


def lens_tensor(values, dtype, on_cpu):
    return torch.tensor(list(values), dtype=dtype, device="cpu" if on_cpu else device())


def packed_qkv(T, hq, hkv, d, dv, dtype, g, packed):
    """q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,Dv]; packed=True gives LMDeploy's strided views of one
    fused qkv buffer (row stride (Hq + Hkv) * D + Hkv * Dv), as split_qkv makes them."""
    if not packed:
        return randn((T, hq, d), dtype, g), randn((T, hkv, d), dtype, g), randn((T, hkv, dv), dtype, g)
    qkv = randn((T, hq * d + hkv * d + hkv * dv), dtype, g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * dv], dim=-1)
    return q.unflatten(-1, (hq, d)), k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, dv))


def every_other(t: torch.Tensor) -> torch.Tensor:
    """A view with t's values whose last dim has stride 2 (a strided input, not a copy)."""
    buf = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
    buf[..., ::2] = t
    buf[..., 1::2] = float("nan") if t.is_floating_point() else -(2**30)
    return buf[..., ::2]


# ---------------------------------------------------------------- paged KV


def cache_shape(nb, bs, h, d, layout):
    return (nb, bs, h, d) if layout == "token_major" else (nb, h, bs, d)


def alloc_cache(nb, bs, h, d, layout, dtype, fill):
    shape = cache_shape(nb, bs, h, d, layout)
    if isinstance(fill, torch.Generator):
        return randn(shape, dtype, fill)
    return torch.full(shape, fill, dtype=dtype, device=device())


def fenced_cache(nb, bs, h, d, layout, dtype, g):
    """(buffer, cache): a random [NB, ...] cache inside a buffer with a NaN block before and after
    it. A kernel that wraps a negative block id around or addresses past the cache reads a NaN
    (and the output shows it) or writes into the fence (and the buffer shows it)."""
    block = cache_shape(1, bs, h, d, layout)[1:]
    buf = torch.full((nb + 2, *block), float("nan"), dtype=dtype, device=device())
    buf[1:nb + 1] = randn((nb, *block), dtype, g)
    return buf, buf[1:nb + 1]


GARBAGE = (2**30 + 7, -1, -(2**20), 123456789)


@dataclass
class Paged:
    block_table: torch.Tensor  # [B, M], garbage past each sequence's last block
    num_blocks: int
    used: list = field(default_factory=list)  # per sequence, its physical block ids


def make_block_table(kv_lens, block_size, g, index_dtype, spare_blocks=3, extra_cols=2):
    """Shuffled physical blocks per sequence; unused entries hold garbage (huge, negative and
    valid ids of other sequences' blocks)."""
    need = [math.ceil(n / block_size) for n in kv_lens]
    nb = sum(need) + spare_blocks
    perm = torch.randperm(nb, generator=g).tolist()
    M = max(need, default=0) + extra_cols
    table = []
    used = []
    pos = 0
    for b, n in enumerate(need):
        ids = perm[pos: pos + n]
        pos += n
        used.append(ids)
        row = list(ids)
        for j in range(M - n):
            choice = (b + j) % (len(GARBAGE) + 1)
            row.append(GARBAGE[choice] if choice < len(GARBAGE) else perm[(pos + j) % nb])
        table.append(row)
    bt = torch.tensor(table, dtype=torch.int64).reshape(len(kv_lens), M)
    if index_dtype == torch.int32 and not all(-(2**31) <= v < 2**31 for row in table for v in row):
        raise ValueError("a block id does not fit int32")
    return Paged(bt.to(dtype=index_dtype, device=device()), nb, used)


def slots_of(paged, b, positions, block_size):
    blocks = paged.used[b]
    return [blocks[p // block_size] * block_size + p % block_size for p in positions]


def write_cache(cache, slots, values, block_size, layout):
    """Independent writer (the checks' own, not fill_kv_cache): values [n, H, D] to n distinct slots."""
    slots = [int(s) for s in slots]
    if len(set(slots)) != len(slots):
        raise ValueError("write_cache: slots repeat")
    if slots:
        cache[slot_rows(cache, slots, block_size, layout)] = values.to(device=cache.device, dtype=cache.dtype)
