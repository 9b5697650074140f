"""The OpenMP worker pool of the calling thread (GNU libgomp, which torch's Linux builds use).

libgomp gives every thread that opens a parallel region a pool of its own workers, and counts
all of them: once the process holds more pool threads than CPUs (two pools on a 2-core machine),
idle workers stop spin-waiting after ~100 spins and sleep, so every later parallel region pays a
futex wake-up of its workers (tens of microseconds in a VM; a decode step opens hundreds).
An engine that warms up on one thread and serves on another ends up exactly there: freeing the
warm-up thread's pool once it is done keeps the serving thread's workers spinning.
"""

from __future__ import annotations

import ctypes
import functools
import os

_OMP_PAUSE_HARD = 2


@functools.lru_cache(maxsize=1)
def _libgomp():
    """The libgomp torch's parallel regions run on, or None.

    Other wheels bundle renamed copies (sentencepiece's `libgomp-<hash>.so`) with pools of their
    own: the one that counts is the copy inside torch's package, else the one registered under
    the standard soname (what any `-fopenmp` library binds to).
    """
    import torch

    try:
        with open("/proc/self/maps") as maps:
            mapped = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:  # not Linux: no libgomp to look for
        return None
    torch_dir = os.path.dirname(torch.__file__)
    candidates = sorted(p for p in mapped if p.startswith(torch_dir)) + ["libgomp.so.1"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only if already loaded
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads of the calling thread's pool; True if freed.

    Safe whenever the calling thread is not inside a parallel region: its next parallel region
    starts a new pool. Does nothing (False) without libgomp, e.g. with LLVM's or Intel's OpenMP.
    """
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
