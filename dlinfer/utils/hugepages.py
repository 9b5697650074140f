"""Backing large host tensors with 2 MB pages (Linux transparent huge pages).

The paged KV cache is read in rows scattered over many 4 KB pages (in the token-major layout a
cached key row of one head is followed by the other heads' rows, several KB away): with 4 KB
pages, decode attention over a long context spends a large share of its time on TLB misses.
On Linux with THP in `madvise` mode (the common default), memory is backed by 2 MB pages only
where asked for. `empty_on_huge_pages` allocates a tensor whose memory is advised (MADV_HUGEPAGE)
before anything touches it, so the page faults of its first write map 2 MB pages directly;
`use_huge_pages` does it for memory already in use, collapsing it at once (MADV_COLLAPSE, Linux
6.1+; it copies, about 2 s per GB) instead of leaving it to khugepaged. Everything here is a hint:
where the kernel refuses, the memory keeps its 4 KB pages.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE = 2 << 20


@functools.lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _range(t: torch.Tensor):
    """The 2 MB-aligned (start, length) inside t's storage, or None."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    first, last = -(-start // _HUGE) * _HUGE, end // _HUGE * _HUGE
    return (first, last - first) if last > first else None


def empty_on_huge_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, its memory advised for 2 MB pages before first touch
    (large allocations are fresh mmap-ed memory, so the first write faults in huge pages)."""
    t = torch.empty(shape, dtype=dtype)
    madvise = _madvise()
    span = _range(t) if madvise is not None and t.numel() else None
    if span is not None:
        madvise(span[0], span[1], _MADV_HUGEPAGE)
    return t


def use_huge_pages(t: torch.Tensor) -> bool:
    """Ask for the 2 MB-aligned part of a CPU tensor's memory to be backed by huge pages.

    Returns True when the kernel collapsed the range into huge pages now (False: refused, too
    small, not Linux, or only advised for later). The tensor's contents are unchanged.
    """
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu" or t.numel() == 0:
        return False
    span = _range(t)
    if span is None or madvise(span[0], span[1], _MADV_HUGEPAGE) != 0:
        return False
    return madvise(span[0], span[1], _MADV_COLLAPSE) == 0
