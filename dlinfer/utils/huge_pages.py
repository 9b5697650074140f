"""Large CPU tensors moved onto transparent huge pages (Linux).

Why: a decode step streams every weight once. On 4 KB pages every 4 KB of a weight is a TLB miss
and, in a virtual machine, a two-level page walk. On the Intel Xeon VM of docs/benchmarks.md
("Huge pages for the weights") the cpu vendor's float32 few-row linear over a 512 MB weight
streamed 21.0 GB/s on 4 KB pages and 30.7 GB/s on 2 MB pages, a torch sum 19.1 and 27.8 GB/s.
llama.cpp's weights are an mmap'd GGUF file, which the kernel's page cache backs with large
folios: part of why it read faster than torch allocations did.

How: asking the kernel to collapse a weight where it lies (MADV_COLLAPSE) only reaches the 2 MB
pages that lie wholly inside it, and a model's weights are mostly 1-7 MB tensors at arbitrary
addresses: for SmolLM2-135M that left half of them on 4 KB pages. So `move_to_huge_pages` copies
every distinct storage of the tensors it is given into one arena: a fresh allocation, 2 MB
aligned, advised MADV_HUGEPAGE before its first byte is written (so its pages fault in as 2 MB
pages when the kernel's THP mode is "always" or "madvise"), each storage at a 64-byte boundary.
Each tensor is then re-pointed at its copy in place (`Tensor.set_`: the same Python object, same
shape, strides and storage offset; tensors that shared a storage share its copy), so modules,
optimisers or anything else holding the tensor objects see the moved data. The move goes one
storage at a time: copied, its tensors re-pointed, the old storage dropped (freed once nothing else
references it) and, every 256 MB, glibc asked to return freed memory (`release_free_memory`); so the
process holds the weights once plus one storage, not twice (docs/lmdeploy.md, "Memory while
loading"). Call it before anything records data pointers (a
compiled graph, a captured op).

Nothing fails hard: off Linux, with THP turned off, or without free huge pages the memory stays on
4 KB pages (moved or not) and the report says so.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Iterable, NamedTuple, Optional

HUGE_PAGE = 2 << 20


def allowed_shortfall(nbytes: int) -> int:
    """Bytes of an arena of `nbytes` that may stay on 4 KB pages without a report: its last partial
    page, and a few of the pages the kernel had no free 2 MB frame for (1/256 of the arena: 60 MB
    of an 8B model's 15 GB), which cost nothing measurable."""
    return max(HUGE_PAGE, nbytes // 256)
MADV_HUGEPAGE = 14
_ALIGN = 64


class Report(NamedTuple):
    """bytes: the storages' bytes moved; huge: bytes of them the kernel backs with huge pages
    (from /proc/self/smaps; at most `bytes`); problem: why not all of it is (None when all is)."""
    bytes: int
    huge: int
    problem: Optional[str]


def _thp_mode() -> Optional[str]:
    """The system's THP mode ("always", "madvise", "never"), or None when it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.find("[") + 1:text.find("]")] if "[" in text else None


def _madvise_huge(start: int, length: int) -> Optional[str]:
    """madvise(MADV_HUGEPAGE) on [start, start + length); None or why it failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    if libc.madvise(start, length, MADV_HUGEPAGE) != 0:
        return f"madvise(MADV_HUGEPAGE) failed: {os.strerror(ctypes.get_errno())}"
    return None


def huge_bytes(start: int, end: int, smaps: str = "/proc/self/smaps") -> int:
    """Bytes of [start, end) in this process's mappings backed by anonymous huge pages (the
    AnonHugePages of every mapping that lies inside the range)."""
    total, inside = 0, False
    with open(smaps) as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo >= start and hi <= end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


_TRIM_EVERY = 256 << 20  # bytes moved between two release_free_memory() calls


def release_free_memory() -> bool:
    """Ask glibc to hand the memory it holds free back to the kernel (malloc_trim(0): free pages
    anywhere in its heaps, not only at their tops). Storages below glibc's mmap threshold (which
    rises up to 32 MB as large blocks are freed) live in those heaps, and freeing them does not
    shrink the process by itself. True when glibc released something; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def empty_arena(nbytes: int):
    """(arena, problem): an uninitialised uint8 [nbytes] tensor starting on a 2 MB boundary, advised
    MADV_HUGEPAGE before any of its bytes is written, so that its pages fault in as 2 MB pages where
    the kernel's THP mode allows; problem: None, or why the advice failed. The tensor is a view of
    a slightly larger allocation (its storage_offset() bytes in)."""
    import torch

    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: its pages fault in when written
    skip = (-raw.data_ptr()) % HUGE_PAGE
    span = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    problem = _madvise_huge(raw.data_ptr() + skip, min(span, raw.numel() - skip)) if sys.platform.startswith(
        "linux") else "huge pages are only asked for on Linux"
    return raw[skip:skip + nbytes], problem


def move_to_huge_pages(tensors: Iterable) -> Report:
    """Copy the CPU storages of `tensors` into one huge-page arena and re-point every tensor at
    its copy (module docstring); returns what happened. Other devices' tensors, empty ones and
    duplicates are skipped."""
    import torch

    unique = {id(t): t for t in tensors if t is not None and t.device.type == "cpu" and t.untyped_storage().nbytes()}
    # storage key (data_ptr, taken before any move) -> [storage, offset in the arena, its tensors]
    storages: dict[int, list] = {}
    size = 0
    for t in unique.values():
        s = t.untyped_storage()
        entry = storages.get(s.data_ptr())
        if entry is None:
            entry = storages[s.data_ptr()] = [s, size, []]
            size += (s.nbytes() + _ALIGN - 1) // _ALIGN * _ALIGN
        entry[2].append(t)
    unique = t = s = None  # no reference of ours may keep an old storage alive
    if not storages:
        return Report(0, 0, None)
    if not sys.platform.startswith("linux"):
        return Report(0, 0, "huge pages are only asked for on Linux: the tensors were left where they are")
    mode = _thp_mode()
    if mode == "never":
        return Report(0, 0, "transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled: never): "
                            "the tensors were left where they are")
    arena, problem = empty_arena(size)
    span = (size + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    skip = arena.storage_offset()
    arena_storage = arena.untyped_storage()
    since_trim = 0
    # inference mode: a model loaded under it holds inference tensors, which only it may update in
    # place; for other tensors it is no_grad
    with torch.inference_mode():
        for entry in storages.values():
            old, offset, owners = entry
            nbytes = old.nbytes()
            arena[offset:offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            base = skip + offset  # byte offset of the copy in the arena's storage
            for t in owners:
                t.set_(arena_storage, (base + t.storage_offset() * t.element_size()) // t.element_size(),
                       t.shape, t.stride())
            # the old storage goes as soon as nothing else holds it: one storage at a time, so the
            # move holds the arena's filled part plus one storage, not two copies of everything
            entry[0] = entry[2] = old = owners = None
            since_trim += nbytes
            if since_trim >= _TRIM_EVERY:
                release_free_memory()
                since_trim = 0
    release_free_memory()
    huge = min(size, huge_bytes(arena.data_ptr(), arena.data_ptr() + span))  # the last page's tail is not the tensors'
    if problem is None and huge < size - allowed_shortfall(size):
        problem = (f"the kernel backed {huge / 2**20:.0f} of {size / 2**20:.0f} MB with huge pages (THP mode "
                   f"{mode or 'unknown'}; free 2 MB pages may be short)")
    return Report(size, huge, problem)
