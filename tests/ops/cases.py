"""Vendors, devices and adversarial shape generators shared by the op parity tests.

Every shape set has a `small` subset: vendors that run interpreted here (triton under
TRITON_INTERPRET=1, ~300x slower) get only those.
"""

import contextlib
import math
import os
from dataclasses import dataclass, field

import pytest
import torch

import dlinfer.vendor

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_PARAMS = [pytest.param(dt, id=str(dt).replace("torch.", "")) for dt in DTYPES]
LAYOUTS = ("token_major", "head_major")

VENDORS = tuple(dlinfer.vendor.available())
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def small_only(vendor):
    return vendor == "triton" and INTERPRETED


def vendor_marks(vendor):
    return [pytest.mark.triton] if vendor == "triton" else []


def vendor_layouts(vendor):
    return tuple(dlinfer.vendor.load(vendor).kv_layouts)


def vendor_params(cases=None, with_layout=False):
    """pytest params: vendor [x layout] [x case]; interpreted vendors get the small cases only.

    Arguments of the test: (vendor), (vendor, layout), (vendor, case) or (vendor, layout, case).
    """
    params = []
    for vendor in VENDORS:
        layouts = vendor_layouts(vendor) if with_layout else (None,)
        for layout in layouts:
            head = (vendor,) if layout is None else (vendor, layout)
            hid = "-".join(head)
            if cases is None:
                params.append(pytest.param(*head, id=hid, marks=vendor_marks(vendor)))
                continue
            for case in cases:
                if small_only(vendor) and not case.small:
                    continue
                params.append(pytest.param(*head, case, id=f"{hid}-{case.id}", marks=vendor_marks(vendor)))
    return params


def skip_unless_supported(vendor, dtype=None, head_dim=None, feature=None):
    """Skip combinations the vendor declares it does not run (those raise UnsupportedError,
    tested in test_bad_inputs.py): dtypes, head dims, optional features. The torch vendor, the
    reference implementation every op falls back to, must run everything: never skipped."""
    if vendor == "torch":
        return
    caps = dlinfer.vendor.load(vendor).capabilities
    if dtype is not None and dtype not in caps.dtypes:
        pytest.skip(f"{vendor} declares no {dtype}")
    if head_dim is not None and caps.head_dims is not None and head_dim not in caps.head_dims:
        pytest.skip(f"{vendor} declares no head dim {head_dim}")
    if feature is not None and not dlinfer.vendor.load(vendor).supports(feature):
        pytest.skip(f"{vendor} declares no {feature}")


@contextlib.contextmanager
def active(vendor, layout=None):
    if layout is None:
        with dlinfer.vendor.using(vendor):
            yield
    else:
        with dlinfer.vendor.using(vendor, kv_layout=layout):
            yield


def gen(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def seed_of(*parts):
    """A stable seed from test parameters (hash() of str is salted per process)."""
    s = 0
    for ch in "|".join(str(p) for p in parts):
        s = (s * 131 + ord(ch)) % (2**31 - 1)
    return s


_MEMO = {}


def memo(key, fn):
    """Compute an fp64 reference once per key (inputs are a pure function of their seed, so a test
    that runs under several vendors / layouts / options shares one reference)."""
    if key not in _MEMO:
        _MEMO[key] = fn()
    return _MEMO[key]


def randn(shape, dtype, g, scale=1.0, device=DEVICE):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def lens_tensor(values, dtype, on_cpu):
    return torch.tensor(list(values), dtype=dtype, device="cpu" if on_cpu else DEVICE)


def packed_qkv(T, hq, hkv, d, dv, dtype, g, packed):
    """q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,Dv]; packed=True gives LMDeploy's strided views of one
    fused qkv buffer (row stride (Hq + Hkv) * D + Hkv * Dv), as split_qkv makes them."""
    if not packed:
        return randn((T, hq, d), dtype, g), randn((T, hkv, d), dtype, g), randn((T, hkv, dv), dtype, g)
    qkv = randn((T, hq * d + hkv * d + hkv * dv), dtype, g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * dv], dim=-1)
    return q.unflatten(-1, (hq, d)), k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, dv))


# ---------------------------------------------------------------- paged KV


def alloc_cache(nb, bs, h, d, layout, dtype, fill):
    shape = (nb, bs, h, d) if layout == "token_major" else (nb, h, bs, d)
    if isinstance(fill, torch.Generator):
        return randn(shape, dtype, fill)
    return torch.full(shape, fill, dtype=dtype, device=DEVICE)


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
    if index_dtype == torch.int32:
        assert all(-(2**31) <= v < 2**31 for row in table for v in row)
    return Paged(bt.to(dtype=index_dtype, device=DEVICE), nb, used)


def slots_of(paged, b, positions, block_size):
    blocks = paged.used[b]
    return [blocks[p // block_size] * block_size + p % block_size for p in positions]


def write_cache(cache, slots, values, block_size, layout):
    """Independent writer (the test's own, not fill_kv_cache): values [n, H, D] to slots."""
    from .reference import cache_slot_view

    for i, slot in enumerate(slots):
        cache_slot_view(cache, slot, block_size, layout).copy_(values[i])


@dataclass(frozen=True)
class AttnCase:
    id: str
    seqs: tuple  # ((history, new), ...) per sequence
    hq: int
    hkv: int
    d: int
    dv: int
    bs: int
    small: bool
    index_dtype: torch.dtype = torch.int32
    lens_on_cpu: bool = True
    packed: bool = True  # q/k/v as strided views of one qkv buffer
    scale: float = None  # softmax_scale
    alibi: bool = False

    @property
    def kv_lens(self):
        return [h + n for h, n in self.seqs]

    @property
    def q_lens(self):
        return [n for _, n in self.seqs]

    @property
    def cu_ends(self):
        out, acc = [], 0
        for n in self.q_lens:
            acc += n
            out.append(acc)
        return out

    @property
    def T(self):
        return sum(self.q_lens)
