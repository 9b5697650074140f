"""dlinfer's build: the metadata is pyproject.toml's; this file adds the cpu vendor's kernels,
compiled ahead of time into a wheel so that an installed dlinfer needs no C++ compiler.

    pip wheel . --no-deps --no-build-isolation -w dist      # torch must be importable while building

One extension module per instruction set (dlinfer/vendor/cpu/build_flags.py: AVX512, AVX2,
DEFAULT), `dlinfer.vendor.cpu._kernels_<isa>`, each stamped with the hash of the sources and
flags, the torch version and the ISA (a string in the file: build_flags.stamp); at run time the
cpu vendor reads the stamp of the one for this CPU from its bytes and imports it only when it
matches (dlinfer/vendor/cpu/build.py), else it builds the kernels as a source checkout does.
`DLINFER_WHEEL_ISAS=avx512,default` builds a subset (each level is about two minutes on 2 cores);
`DLINFER_WHEEL_ISAS=none`, an editable install, or a build without torch (build isolation) gives a
wheel without prebuilt kernels.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "dlinfer" / "vendor" / "cpu" / "csrc"


def _build_flags():
    spec = importlib.util.spec_from_file_location("dlinfer_build_flags", ROOT / "dlinfer/vendor/cpu/build_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels():
    """(ext_modules, cmdclass) of the prebuilt kernels, or nothing (see the module's doc)."""
    chosen = os.environ.get("DLINFER_WHEEL_ISAS", "avx512,avx2,default").lower()
    if "editable_wheel" in sys.argv or chosen in ("", "none"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("[dlinfer] torch is not importable in this build (build isolation?): the wheel carries no prebuilt "
              "kernels; build with --no-build-isolation", file=sys.stderr)
        return [], {}
    bf = _build_flags()
    isas = [isa for isa in bf.ISAS if isa.lower() in chosen.split(",")]
    unknown = set(chosen.split(",")) - {isa.lower() for isa in bf.ISAS}
    if unknown:
        raise SystemExit(f"DLINFER_WHEEL_ISAS: unknown {sorted(unknown)}; expected some of "
                         f"{', '.join(i.lower() for i in bf.ISAS)} (or none)")
    openmp = torch.backends.openmp.is_available()
    sources = [str(p.relative_to(ROOT)) for p in bf.sources(CSRC) if p.suffix == ".cpp"]
    ext = []
    for isa in isas:
        stamp = bf.stamp(bf.sources_hash(CSRC, isa, openmp), torch.__version__, isa)
        ext.append(CppExtension(f"dlinfer.vendor.cpu.{bf.prebuilt_name(isa)}", sources, include_dirs=[str(CSRC)],
                                extra_compile_args=[*bf.flags(isa, openmp), f'-DDLINFER_STAMP="{stamp}"',
                                                    "-g0"]))  # no debug info: Python's CFLAGS add -g (10x the .so)
    return ext, {"build_ext": BuildExtension}


ext_modules, cmdclass = _kernels()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
