"""The cpu vendor's compiler flags per instruction set, and the hash that ties a build to its
sources: shared by the just-in-time build (build.py) and the ahead-of-time one of a wheel
(setup.py, which loads this file by path: it imports nothing of dlinfer).

ISAs: AVX512, AVX2 and DEFAULT (no vector flags), named as torch names its CPU capability
(`torch.backends.cpu.get_cpu_capability()`). The kernels pick AVX-512 VNNI, AVX512_BF16 and AMX
at run time inside an AVX512 build (per-function target attributes), so these three levels cover
every x86-64 CPU. `-ffp-contract=off` keeps a * b + c as two roundings wherever the code writes
them as two (only `fmadd` fuses), so the elementwise ops round as PyTorch's do.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List

ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2", "-mf16c",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "DEFAULT": [],
}
ISAS = tuple(ISA_FLAGS)


def flags(isa: str, openmp: bool) -> List[str]:
    """The C++ flags of a build for `isa` (with OpenMP where torch has it: at::parallel_for is an
    inline OpenMP region, one thread without it)."""
    return ["-O3", "-ffp-contract=off", "-DNDEBUG", *ISA_FLAGS[isa], *(["-fopenmp"] if openmp else [])]


def sources(csrc: Path) -> List[Path]:
    """Every kernel file (one extension module) and every header, sorted."""
    return sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")])


def sources_hash(csrc: Path, isa: str, openmp: bool) -> str:
    """sha256 of the sources' names and bytes and of the flags of a build for `isa`: a prebuilt
    module is used only for the sources and flags it was built from."""
    digest = hashlib.sha256(" ".join(flags(isa, openmp)).encode() + b"\0")
    for path in sources(csrc):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


STAMP_START, STAMP_END = b"dlinfer-stamp[", b"]dlinfer-stamp"  # around csrc/bindings.cpp's stamp


def stamp(sources_digest: str, torch_version: str, isa: str) -> str:
    """What a prebuilt module carries as a string constant (csrc/bindings.cpp), readable from the
    file's bytes before it is loaded."""
    return f"{sources_digest}:{torch_version}:{isa}"


def read_stamp(shared_object: Path):
    """(sources digest, torch version, isa) stamped into a prebuilt module's file, or None; read from
    its bytes, without loading it (a module loaded and then refused would have registered its ops)."""
    data = shared_object.read_bytes()
    start = data.find(STAMP_START)
    end = data.find(STAMP_END, start + len(STAMP_START))
    if start < 0 or end < 0:
        return None
    parts = data[start + len(STAMP_START):end].decode("ascii", "replace").split(":")
    return tuple(parts) if len(parts) == 3 else None


def prebuilt_name(isa: str) -> str:
    """The module a wheel carries for `isa`, inside dlinfer.vendor.cpu."""
    return f"_kernels_{isa.lower()}"
