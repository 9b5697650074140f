"""Facts about this machine that a bug report needs (`python -m dlinfer env`): RAM, CPU model,
vector instruction sets, cores and threads. Read on call, nothing at import; each answer is
None when this OS does not tell.
"""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Dict, List, Optional, Tuple

RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
                      "amx_int8")
"""The /proc/cpuinfo flags that decide which kernels (dlinfer's, oneDNN's) a CPU can run."""


def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def memory() -> Optional[Tuple[int, int]]:
    """(total, available) RAM in bytes."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip()}
        return kib["MemTotal"] * 1024, kib["MemAvailable"] * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total, vm.available
    except Exception:  # no psutil, or it cannot read this OS
        return None


def cpu_model() -> Optional[str]:
    """The CPU's model name: /proc/cpuinfo on Linux, sysctl on macOS, else what `platform` knows."""
    name = _cpuinfo().get("model name")
    if name:
        return name
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or None


def cpu_flags() -> Optional[List[str]]:
    """Which of RELEVANT_CPU_FLAGS the CPU has (None where /proc/cpuinfo gives no flags)."""
    flags = _cpuinfo().get("flags")
    if flags is None:
        return None
    present = set(flags.split())
    return [flag for flag in RELEVANT_CPU_FLAGS if flag in present]


def torch_isa() -> str:
    """The vector instruction set torch dispatches its CPU kernels to (AVX512, AVX2, DEFAULT, ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def cores() -> Tuple[Optional[int], Optional[int]]:
    """(logical cores of the machine, cores this process may run on)."""
    try:
        usable: Optional[int] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return os.cpu_count(), usable


def threads() -> Tuple[int, Optional[str]]:
    """(torch's intra-op thread count, OMP_NUM_THREADS or None when unset)."""
    import torch

    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def last_level_cache_bytes() -> Optional[int]:
    """The largest data or unified cache a CPU of this machine reports (Linux sysfs), in bytes. In
    a virtual machine this is what the host's CPU has, not necessarily what this guest gets."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(base, name, "type"), encoding="utf-8") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(base, name, "size"), encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text) if text.isdigit() else None
        if size is not None and (best is None or size > best):
            best = size
    return best
