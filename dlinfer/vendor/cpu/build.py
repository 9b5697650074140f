"""Building the cpu vendor's C++ kernels (once per machine type, cached).

The kernels (`csrc/*.cpp`) are compiled on first use with torch's own extension builder
(`torch.utils.cpp_extension.load`) against the installed torch, and registered as
`torch.ops.dlinfer_cpu.*`. The build is cached (torch's extension directory, `TORCH_EXTENSIONS_DIR`
to move it) and redone only when a source file or the flags change: about a minute the first
time, a fraction of a second after.

The instruction set is chosen from what this torch detects at run time
(`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2 or plain), not `-march=native`, and it is
part of the module's name: a cache shared between different machines never hands one machine a
build for another's CPU. `-ffp-contract=off` keeps a * b + c as two roundings wherever the code
writes them as two (only `fmadd` fuses), so the elementwise ops round as PyTorch's do.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("linear.cpp", "attention.cpp", "kv_cache.cpp", "norm.cpp", "rotary.cpp", "activation.cpp")

_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2", "-mf16c",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}


def isa() -> str:
    """The vector instruction set the kernels are built for: AVX512, AVX2 or DEFAULT."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _ISA_FLAGS else "DEFAULT"


def flags() -> list:
    out = ["-O3", "-ffp-contract=off", "-DNDEBUG", *_ISA_FLAGS.get(isa(), [])]
    if torch.backends.openmp.is_available():
        out.append("-fopenmp")  # at::parallel_for is an inline OpenMP region: without it, one thread
    return out


def module_name() -> str:
    return f"dlinfer_cpu_kernels_{isa().lower()}"


@contextlib.contextmanager
def _ninja_on_path():
    """torch's builder runs `ninja` from PATH; a venv's ninja (the `ninja` wheel) is not on it when
    the venv was not activated. Within the block it is (PATH is restored afterwards)."""
    saved = os.environ.get("PATH", "")
    if not shutil.which("ninja"):
        candidates = [os.path.dirname(sys.executable)]
        try:
            import ninja

            candidates.insert(0, ninja.BIN_DIR)
        except (ImportError, AttributeError):
            pass
        found = [folder for folder in candidates if os.path.exists(os.path.join(folder, "ninja"))]
        if found:
            os.environ["PATH"] = found[0] + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _fingerprint() -> str:
    """What the build depends on: sources, flags, torch."""
    digest = hashlib.sha256(" ".join(flags() + [torch.__version__]).encode())
    for source in sorted(CSRC.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()


def _log(msg: str) -> None:
    print(f"[dlinfer] {msg}", file=sys.stderr, flush=True)


def build() -> None:
    """Compile (or find in the cache) and load the kernels; raises when no compiler can build them."""
    if hasattr(torch.ops, "dlinfer_cpu") and hasattr(torch.ops.dlinfer_cpu, "linear_few_rows"):
        return
    from torch.utils.cpp_extension import _get_build_directory, load

    name = module_name()
    stamp = Path(_get_build_directory(name, verbose=False)) / "dlinfer.stamp"
    fingerprint = _fingerprint()
    fresh = not stamp.is_file() or stamp.read_text() != fingerprint
    if fresh:
        _log(f"building the cpu vendor's kernels for {isa()} (once per machine and source change, about a "
             f"minute) in {stamp.parent}")
    start = time.perf_counter()
    with _ninja_on_path():
        load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=flags(),
            extra_include_paths=[str(CSRC)],
            is_python_module=False,
            verbose=os.environ.get("DLINFER_BUILD_VERBOSE", "0") not in ("", "0"),
        )
    if fresh:
        stamp.write_text(fingerprint)
        _log(f"cpu vendor kernels built in {time.perf_counter() - start:.0f} s")
