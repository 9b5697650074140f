"""Building the cpu vendor's C++ kernels (once per machine type, cached), or loading the ones a
wheel carries.

A wheel built with `pip wheel . --no-build-isolation` (setup.py) carries the kernels compiled
ahead of time for each instruction set (`build_flags.ISAS`: AVX512, AVX2, DEFAULT) as
`dlinfer.vendor.cpu._kernels_<isa>`. `module()` first reads the stamp of the one for this CPU's
instruction set from its file and imports it when it was built from these very sources and flags
against this torch version; no compiler is needed then. Otherwise (a source checkout, an edited source, another
torch, or `DLINFER_CPU_PREBUILT=0`) it builds them as follows.

The kernels (`csrc/*.cpp`) are compiled on first use with torch's own extension builder
(`torch.utils.cpp_extension.load`) against the installed torch, into one extension module whose
functions the vendor calls (`module()`; csrc/bindings.cpp: no dispatcher on the hot path), each
also registered as `torch.ops.dlinfer_cpu.*` for tests and tools. The builder caches the build
(torch's extension directory, `TORCH_EXTENSIONS_DIR` to move it) and redoes it only when a source,
header or flag changes: about two minutes the first time on a 2-core machine (113 s on the Zen 1
EPYC VM, AVX2), a fraction of a second after. A build that takes more than a moment says so on stderr; a
machine without a C++ compiler or ninja gets a one-line `VendorError` before anything runs (saying
why a prebuilt module could not be used).

The instruction set is chosen from what this torch detects at run time
(`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2 or plain), not `-march=native`, and it is
part of the module's name: a cache shared between different machines never hands one machine a
build for another's CPU. The flags: build_flags.py.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Tuple

import torch

from dlinfer import envs
from dlinfer.errors import VendorError
from dlinfer.vendor.cpu import build_flags

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(sorted(p.name for p in CSRC.glob("*.cpp")))  # every kernel file of csrc/ (one module)
COMPILERS = ("c++", "g++", "clang++")  # looked for in this order when $CXX is not set
_ANNOUNCE_AFTER_S = 2.0  # a load still running after this long is compiling: say so
_loaded = None  # the extension module, once built (or found prebuilt) and imported
_origin = None  # how it came: "prebuilt" or "built"
_load_lock = threading.Lock()
PREBUILT_ENV = "DLINFER_CPU_PREBUILT"
STREAMS_ENV = "DLINFER_CPU_WEIGHT_STREAMS"


def isa() -> str:
    """The vector instruction set the kernels are built for: AVX512, AVX2 or DEFAULT."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in build_flags.ISA_FLAGS else "DEFAULT"


def flags() -> list:
    return build_flags.flags(isa(), torch.backends.openmp.is_available())


def module_name() -> str:
    return f"dlinfer_cpu_kernels_{isa().lower()}"


def find_compiler() -> Optional[Tuple[str, str]]:
    """(path, first line of its `--version`) of the C++ compiler the kernels are built with: $CXX
    when set, else the first of c++, g++, clang++ on PATH; None when there is none."""
    cxx = os.environ.get("CXX", "").split()  # may be a launcher and a compiler: "ccache g++"
    for args in [cxx] if cxx else [[name] for name in COMPILERS]:
        path = shutil.which(args[0])
        if path:
            try:
                done = subprocess.run([path, *args[1:], "--version"], capture_output=True, text=True, timeout=60)
                first = (done.stdout or done.stderr).strip().splitlines()[:1]
            except (OSError, subprocess.SubprocessError):
                first = []
            return path, first[0] if first else "version unknown"
    return None


def _ninja_folder() -> Optional[str]:
    """The folder of the `ninja` the builder will run: on PATH, else the venv's (the `ninja` wheel,
    not on PATH when the venv was not activated); None when there is none."""
    folders = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError, AttributeError):
        import ninja

        folders.insert(0, ninja.BIN_DIR)
    found = shutil.which("ninja") or shutil.which("ninja", path=os.pathsep.join(folders))
    return os.path.dirname(found) if found else None


@contextlib.contextmanager
def _environ(**values: str):
    """os.environ with `values` set within the block, restored afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _log(msg: str) -> None:
    print(f"[dlinfer] {msg}", file=sys.stderr, flush=True)


def module():
    """The kernels' extension module (a wheel's prebuilt one, or built and loaded by `build()` first
    if need be): its functions are csrc/entry_points.h's."""
    return _loaded if _loaded is not None else build()


def origin() -> Optional[str]:
    """How the loaded kernels came: "prebuilt" (a wheel's), "built" (here), None (not loaded yet)."""
    return _origin


def build():
    """The kernels' extension module: a wheel's prebuilt one when it fits (`prebuilt()`), else
    compiled (or found in the cache) and loaded; a one-line VendorError when neither can be had."""
    global _loaded, _origin
    with _load_lock:
        if _loaded is None:
            weight_streams_from_env()  # a bad value refused before minutes of building
            found, why = prebuilt()
            module, origin_ = (found, "prebuilt") if found is not None else (_build(why), "built")
            apply_weight_streams()
            _loaded, _origin = module, origin_
    return _loaded


def weight_streams_from_env() -> int:
    """$DLINFER_CPU_WEIGHT_STREAMS as the kernels' `set_weight_streams` takes it: 0 for auto (or
    unset: the CPU's default), else 1, 2 or 4; a VendorError naming the setting otherwise."""
    value = (envs.get(STREAMS_ENV) or "auto").strip().lower()
    if value not in ("auto", "1", "2", "4"):
        raise VendorError(f"{STREAMS_ENV}={value!r}: expected auto, 1, 2 or 4 (weight streams a thread)")
    return 0 if value == "auto" else int(value)


def apply_weight_streams() -> int:
    """Sets the kernels' weight streams a thread (csrc/few_rows_walk.h, `weight_streams`) from
    $DLINFER_CPU_WEIGHT_STREAMS (`weight_streams_from_env`; the CPU's default is 4 on Intel CPUs
    running the AVX-512 build, else 1); returns the number in effect. Only the speed depends on
    it, never an output's bits."""
    torch.ops.dlinfer_cpu.set_weight_streams(weight_streams_from_env())
    return torch.ops.dlinfer_cpu.weight_streams()


def prebuilt():
    """(module, None) when a wheel carries kernels for this CPU's instruction set built from these
    sources and flags against this torch, else (None, why not). The stamp is read from the file
    before anything is loaded: a module loaded and then refused would have registered its
    `torch.ops.dlinfer_cpu` schemas, and the build that follows could not register them again."""
    if (envs.get(PREBUILT_ENV) or "1") == "0":
        return None, f"{PREBUILT_ENV}=0"
    name = f"dlinfer.vendor.cpu.{build_flags.prebuilt_name(isa())}"
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        return None, f"no prebuilt kernels for {isa()} (a source checkout, or a wheel built without them)"
    found = build_flags.read_stamp(Path(spec.origin))
    want = build_flags.sources_hash(CSRC, isa(), torch.backends.openmp.is_available())
    if found is None or found[2] != isa():
        return None, f"the prebuilt kernels for {isa()} carry no stamp for it"
    if found[0] != want:
        return None, f"the prebuilt kernels for {isa()} were built from other sources or flags than these"
    if found[1] != torch.__version__:
        return None, f"the prebuilt kernels for {isa()} were built for torch {found[1]}, this is {torch.__version__}"
    try:
        return importlib.import_module(name), None
    except ImportError as exc:
        raise VendorError(f"the prebuilt kernels for {isa()} do not load: {exc}") from exc


def build_directory() -> Path:
    """Where torch's extension builder builds and caches this module (TORCH_EXTENSIONS_DIR moves it)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(module_name(), verbose=False))


@contextlib.contextmanager
def _builder_lock(folder: Path):
    """Holds an flock on `folder`/dlinfer.flock while torch's builder runs. torch marks a build in
    progress with a plain file, `lock`, and every other process waits for it to go away, with no
    time limit: a build killed half-way (Ctrl-C, a test run stopped) leaves it behind and every
    later load hangs in silence. The kernel drops an flock when its process dies, so whoever holds
    this one is the only dlinfer builder alive, and a `lock` it finds is stale: removed, and said."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "dlinfer.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another live builder: wait for it, as torch would
        try:
            stale = folder / "lock"
            if stale.exists():
                _log(f"removing {stale}: a build of the cpu vendor's kernels was stopped before it ended")
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(prebuilt_why: str = ""):
    compiler, ninja = find_compiler(), _ninja_folder()
    why = f" ({prebuilt_why})" if prebuilt_why else ""
    if compiler is None:
        looked = f"$CXX={os.environ['CXX']}" if os.environ.get("CXX") else "$CXX, " + ", ".join(COMPILERS)
        raise VendorError(f"no C++ compiler found (looked for {looked}): the cpu vendor's kernels cannot be built"
                          f"{why}; install g++ (or set CXX), or a dlinfer wheel with prebuilt kernels")
    if ninja is None:
        raise VendorError(f"ninja not found (looked on PATH and beside this Python): the cpu vendor's kernels cannot "
                          f"be built{why}; pip install ninja")
    from torch.utils.cpp_extension import load

    env = {}  # the builder runs `ninja` from PATH and compiles with $CXX, c++ when unset: make both the ones found
    if not shutil.which("ninja"):
        env["PATH"] = ninja + os.pathsep + os.environ.get("PATH", "")
    if not os.environ.get("CXX") and not shutil.which("c++"):
        env["CXX"] = compiler[0]
    start, announced = time.perf_counter(), threading.Event()

    def announce() -> None:
        announced.set()
        _log(f"building the cpu vendor's kernels for {isa()} (once per machine and source change; minutes on "
             "2 cores) ...")

    timer = threading.Timer(_ANNOUNCE_AFTER_S, announce)
    timer.daemon = True
    timer.start()
    try:
        with _environ(**env), _builder_lock(build_directory()):
            loaded = load(
                name=module_name(),
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=flags(),
                extra_include_paths=[str(CSRC)],
                is_python_module=True,
                verbose=(envs.get("DLINFER_BUILD_VERBOSE") or "0") != "0",
            )
    finally:
        timer.cancel()
    if announced.is_set():
        _log(f"cpu vendor kernels built in {time.perf_counter() - start:.0f} s")
    return loaded
