"""What the tools save of a call, and how a replay rebuilds it (docs/tools.md, "What is saved, and the KV caches").

Read sets of the paged KV caches. A paged attention call gets whole per-layer caches, but reads
only the blocks its block table names for the positions `kv_seq_len` covers; a KV fill writes
only the blocks of its slots. `compact_kv` keeps just those blocks (a copy, in the order of their
ids) and rewrites the block table / slots to index the smaller cache the same way, with the
kernels' own rules for bad metadata: block ids clamped into [0, NB), lengths into the row, slots
outside the cache skipped (mapped to -1). A correct vendor gives the same result on the compacted
call; what it cannot show is a vendor that reads blocks the call does not name.

Tensor arguments. Arguments that overlap in memory (LMDeploy passes attention's `out` as a view of
its query) are saved as one flat span with each argument's offset, shape and strides, so a replay
rebuilds the same aliasing and the same (non-contiguous) strides over fresh memory. Tensors of
64 KiB or more, and every KV block, are content-addressed blobs (`blobs/<hash>.pt`, written once):
a weight read in every step, or a cache block unchanged since the last step, is stored once.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Optional, Tuple

import torch

from dlinfer.vendor.kv_layouts import blocks_and_size

FORMAT = 1
INLINE_BYTES = 64 * 1024  # smaller tensors live in the call's own file
KV_OPS_INDEX = {"fill_kv_cache": "kv_indices", "paged_prefill_attention": "block_table",
                "paged_decode_attention": "block_table"}
CACHE_ARGS = ("key_cache", "value_cache")


def compact_kv(op: str, named: dict) -> Tuple[Optional[torch.Tensor], Dict[str, torch.Tensor]]:
    """(ids of the cache blocks the call reads or writes, sorted, int64 on the cache's device;
    {index argument: its rewrite for the compacted caches}); (None, {}) when the op has no cache
    or the cache has no block."""
    index_arg = KV_OPS_INDEX.get(op)
    if index_arg is None:
        return None, {}
    cache, layout = named["key_cache"], named["kv_layout"]
    nb, bs = blocks_and_size(cache, layout)
    if nb == 0:
        return None, {}
    if op == "fill_kv_cache":
        slots = named["kv_indices"].long()
        valid = (slots >= 0) & (slots < nb * bs)
        block_of = torch.div(slots, bs, rounding_mode="floor").clamp(0, nb - 1)
        blocks = torch.unique(block_of[valid])
        if blocks.numel() == 0:
            blocks = block_of.new_zeros(1)
        new = torch.searchsorted(blocks, block_of) * bs + slots % bs
        new = torch.where(valid, new, torch.full_like(new, -1))
        return blocks, {"kv_indices": new.to(named["kv_indices"].dtype)}
    table = named["block_table"]
    kv_len = named["kv_seq_len"].long().clamp(min=0)
    m = table.shape[1]
    n_blocks = torch.div(kv_len + bs - 1, bs, rounding_mode="floor").clamp(max=m)
    used = torch.arange(m, device=table.device).unsqueeze(0) < n_blocks.to(table.device).unsqueeze(1)
    ids = table.long().clamp(0, nb - 1)
    blocks = torch.unique(ids[used])
    if blocks.numel() == 0:
        blocks = ids.new_zeros(1)
    new_table = torch.zeros_like(table)
    new_table[used] = torch.searchsorted(blocks, ids[used]).to(table.dtype)
    return blocks, {"block_table": new_table}


def compacted_args(call, kv_mode: str = "blocks") -> Tuple[list, Optional[torch.Tensor]]:
    """The call's arguments with its caches cut to the blocks it touches (`compact_kv`; kv_mode
    "full" keeps them whole), and those blocks' ids (None when nothing was cut)."""
    args = list(call.args)
    if kv_mode != "blocks" or call.op not in KV_OPS_INDEX:
        return args, None
    named = call.named()
    blocks, rewrites = compact_kv(call.op, named)
    if blocks is None:
        return args, None
    names = call.names
    for name, value in rewrites.items():
        args[names.index(name)] = value
    for name in CACHE_ARGS:
        i = names.index(name)
        args[i] = args[i].index_select(0, blocks.to(args[i].device))
    return args, blocks


def cache_after(cache: torch.Tensor, blocks: Optional[torch.Tensor]) -> torch.Tensor:
    """A cache's blocks `blocks` after the call (the whole cache when blocks is None), a copy."""
    return cache.clone() if blocks is None else cache.index_select(0, blocks.to(cache.device))


# ---------------------------------------------------------------------------------------------
# Encoding for disk


def _extent(t: torch.Tensor) -> Tuple[int, int]:
    lo = t.storage_offset()
    return lo, lo + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _host(t: torch.Tensor) -> torch.Tensor:
    """A compact CPU copy of t (contiguous, its own storage)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu", copy=True).contiguous()
    return t.clone(memory_format=torch.contiguous_format)


class Pending:
    """A record being built: small tensors inline, larger ones as blobs (hash -> tensor) that the
    writer stores unless a blob of that hash exists."""

    def __init__(self):
        self.blobs: Dict[str, torch.Tensor] = {}
        self.inline_bytes = 0

    def ref(self, t: torch.Tensor, blob: bool = False):
        """t (on any device) as something a record holds: an inline CPU tensor or "blob:<hash>"."""
        host = _host(t)
        nbytes = host.numel() * host.element_size()
        if not blob and nbytes < INLINE_BYTES:
            self.inline_bytes += nbytes
            return host
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{host.dtype}{list(host.shape)}".encode())
        h.update(host.reshape(-1).view(torch.uint8).numpy().data if nbytes else b"")
        key = h.hexdigest()
        self.blobs[key] = host
        return f"blob:{key}"

    def cache(self, t: torch.Tensor) -> list:
        """A (compacted) cache as one blob per block: blocks unchanged since an earlier call are
        stored once."""
        return ["kv", [self.ref(t[i], blob=True) for i in range(t.shape[0])]]


def encode_args(args: list, cache_positions: Tuple[int, ...], pending: Pending) -> Tuple[list, list]:
    """(spans, entries): every tensor argument as a view of a flat span (overlapping arguments
    share one), caches (positions `cache_positions`) as per-block blobs, other values as they are."""
    entries: List[Optional[list]] = [None] * len(args)
    groups: Dict[tuple, list] = {}  # (storage, dtype, device) -> [(lo, hi, position)]
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            entries[i] = ["v", a]
        elif i in cache_positions:
            entries[i] = pending.cache(a)
        elif a.numel() == 0:
            entries[i] = ["e", list(a.shape), str(a.dtype).replace("torch.", "")]
        else:
            key = (a.untyped_storage().data_ptr(), a.dtype, a.device)
            groups.setdefault(key, []).append((*_extent(a), i))
    spans: list = []
    for members in groups.values():
        members.sort()
        merged: List[list] = []  # [lo, hi, [positions]]: overlapping extents merge
        for lo, hi, i in members:
            if merged and lo < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
                merged[-1][2].append(i)
            else:
                merged.append([lo, hi, [i]])
        for lo, hi, positions in merged:
            flat = args[positions[0]].detach().as_strided((hi - lo,), (1,), lo)
            spans.append(pending.ref(flat))
            for i in positions:
                a = args[i]
                entries[i] = ["t", len(spans) - 1, a.storage_offset() - lo, list(a.shape), list(a.stride())]
    return spans, entries


# ---------------------------------------------------------------------------------------------
# Reading back


class BlobCache:
    """Blobs of one capture directory, loaded on demand, the most recent kept up to `max_bytes`."""

    def __init__(self, root: str, max_bytes: int = 2 << 30):
        self.root, self.max_bytes = root, max_bytes
        self._items: Dict[str, torch.Tensor] = {}
        self._bytes = 0

    def get(self, ref) -> torch.Tensor:
        if isinstance(ref, torch.Tensor):
            return ref
        key = ref[len("blob:"):]
        hit = self._items.get(key)
        if hit is None:
            hit = torch.load(os.path.join(self.root, "blobs", f"{key}.pt"), weights_only=True)
            self._items[key] = hit
            self._bytes += hit.numel() * hit.element_size()
            while self._bytes > self.max_bytes and len(self._items) > 1:
                old = next(iter(self._items))
                dropped = self._items.pop(old)
                self._bytes -= dropped.numel() * dropped.element_size()
        return hit

    def value(self, stored) -> torch.Tensor:
        """A result or written value as saved: a tensor, a blob, or ["kv", blocks]."""
        if isinstance(stored, list) and stored and stored[0] == "kv":
            return torch.stack([self.get(r) for r in stored[1]])
        return self.get(stored)


def decode_args(record: dict, blobs: BlobCache, device: torch.device) -> list:
    """The call's arguments rebuilt on `device`: fresh memory, the captured strides and aliasing."""
    spans = [blobs.get(ref).to(device, copy=True) for ref in record["spans"]]
    args = []
    for entry in record["args"]:
        kind = entry[0]
        if kind == "v":
            args.append(entry[1])
        elif kind == "t":
            _, span, offset, shape, stride = entry
            args.append(spans[span].as_strided(shape, stride, offset))
        elif kind == "e":
            args.append(torch.empty(entry[1], dtype=getattr(torch, entry[2]), device=device))
        elif kind == "kv":
            args.append(blobs.value(entry).to(device, copy=True))
        else:
            raise ValueError(f"capture record of call #{record.get('call')}: unknown argument kind {kind!r}")
    return args
