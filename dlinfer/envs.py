"""Every DLINFER_* environment variable: its name, default, what it does and who reads it, in one
place. Modules read them through `get` (never `os.environ` directly: tests/test_envs.py checks), so
this table is the complete list; `python -m dlinfer env` prints the effective values and
docs/settings.md lists them. Nothing is read at import: each variable is read when its module
acts on it (the `read` column), and each module still checks its own values and names the
variable in its error (the messages tell the user what the module expected).
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple


class Setting(NamedTuple):
    name: str
    default: str  # what unset means, in words or as the value it stands for
    doc: str
    read: str  # the module that reads it, and when


SETTINGS: Tuple[Setting, ...] = (
    # vendor selection and op checks
    Setting("DLINFER_VENDOR", "cpu on CPU tensors, triton on CUDA, else torch",
            "the vendor every op runs on (torch, cpu, triton or an out-of-tree vendor's name); a named vendor that "
            "cannot load is an error", "vendor/selection.py, at the first op"),
    Setting("DLINFER_KV_LAYOUT", "the vendor's first layout",
            "the KV-cache layout (token_major or head_major) when DLINFER_VENDOR names a vendor",
            "vendor/selection.py, at the first op"),
    Setting("DLINFER_FALLBACK_OPS", "none", "comma-separated ops (or all) forced onto the torch vendor",
            "vendor/selection.py, at each op's first resolution"),
    Setting("DLINFER_CHECK_VALUES", "0", "1: also check values (slots, block ids, lengths; a device sync per op)",
            "ops/_checks.py, at the first op (dlinfer.ops.set_value_checks overrides)"),
    # the cpu vendor
    Setting("DLINFER_CPU_LINEAR", "onednn", "float32 linear beyond the few-row kernel: onednn or aten",
            "vendor/torch/linear.py, at the first float32 CPU call"),
    Setting("DLINFER_CPU_W4_LAYOUT", "auto", "the layout W4A16 weights are repacked into at load: auto, "
            "column_tiled or k_interleaved", "vendor/cpu/weight_quant.py, at each repack"),
    Setting("DLINFER_CPU_W4_ACTIVATIONS", "auto", "auto: int16 for bfloat16 models on AVX2 builds, else "
            "native; native: W4 weights multiply x at its own precision; int8: x quantised to 8 bits per row "
            "and group first (faster, less exact; needs AVX-512 VNNI, or AVX2 on a CPU without AVX-512, and the "
            "k_interleaved layout); int16: x as 16-bit integers per row and group (a power-of-two step, at most "
            "2^-14 of the group's largest |x| off; past 256 rows BLAS on the dequantised weight instead; AVX2 builds "
            "only, k_interleaved)",
            "vendor/cpu/weight_quant.py, at each repack and eager call; vendor/cpu/graph_bindings.py, at each compile"),
    Setting("DLINFER_CPU_WEIGHT_STREAMS", "auto: 4 on Intel CPUs running the AVX-512 build, else 1",
            "weight streams a thread of the few-row linears and the int8 GEMV reads side by side while the "
            "activations fit in L1: 1, 2 or 4 (at most 2 from five rows of activations on, 1 in the int8 GEMV "
            "there; AVX2 builds read two far rows at up to four rows whatever it says; the same outputs, only "
            "the speed changes)",
            "vendor/cpu/build.py, when the cpu vendor's kernels load"),
    Setting("DLINFER_CPU_PREBUILT", "1", "0: build the cpu vendor's kernels here even where a wheel carries "
            "prebuilt ones for these sources and this torch", "vendor/cpu/build.py, at the first cpu op"),
    Setting("DLINFER_BUILD_VERBOSE", "0", "1: show the compiler's output while the cpu vendor's kernels build",
            "vendor/cpu/build.py, at the build"),
    # graph mode
    Setting("DLINFER_GRAPH_PASSES", "all", "the rewrite passes to run: all, none, a list, or a list of -name to "
            "skip", "graph/backend.py, at each compile"),
    Setting("DLINFER_GRAPH_COMPILER", "the vendor's compiler, else direct",
            "the compiler after the passes: direct, auto, inductor, eager", "graph/backend.py and "
            "framework/lmdeploy_ext/graph_mode/runner.py, at each compile"),
    Setting("DLINFER_GRAPH_BIND", "1", "0: the direct compiler calls each op's vendor function instead of the "
            "kernel the vendor's graph_bindings choose once per call site", "graph/backend.py, at each compile"),
    Setting("DLINFER_GRAPH_GUARDS", "warm", "warm: evaluate only the guards that tell buckets apart once warm; "
            "full: every guard, every step (and no replay)",
            "framework/lmdeploy_ext/graph_mode/runner.py, when a graph runner is built"),
    Setting("DLINFER_GRAPH_BATCH", "dynamic", "dynamic: one decode graph traced for every bucket, compiled per "
            "bucket with its sizes fixed; static: one traced per bucket (a slower start)",
            "framework/lmdeploy_ext/graph_mode/runner.py, when a graph runner is built"),
    Setting("DLINFER_GRAPH_REPLAY", "1", "0: call compiled graphs through Dynamo every step instead of replaying "
            "them", "framework/lmdeploy_ext/graph_mode/runner.py, when a graph runner is built"),
    # the LMDeploy adaptor
    Setting("DLINFER_LM_HEAD", "auto", "int8, int4, float or auto (int8 for quantised checkpoints): the LM head "
            "after loading", "framework/lmdeploy_ext/backend/lm_head.py, when the engine builds its model"),
    Setting("DLINFER_HUGE_PAGES", "1", "0: leave a CPU engine's weights where they load instead of moving them "
            "onto 2 MB pages", "framework/lmdeploy_ext/patches/huge_pages.py, when the engine builds its model"),
    Setting("DLINFER_SERVE_SHUTDOWN_S", "30", "seconds `python -m dlinfer serve` lets in-flight requests run after "
            "SIGTERM/SIGINT before it cancels them (uvicorn's graceful-shutdown timeout); the engine then closes in "
            "at most 10 s more", "framework/lmdeploy_ext/serve.py, when the server starts"),
    Setting("DLINFER_SERVE_MAX_BODY", "64M", "the largest request body `python -m dlinfer serve` reads (64M, 512k, "
            "1G); a larger one is answered 413", "framework/lmdeploy_ext/serve.py, when the server starts"),
    Setting("DLINFER_FAIL_FORWARD_TOKEN", "unset", "tests only: <token id>[:start|model|output]; a step whose "
            "model inputs hold that id raises there (drives the failed-forward recovery through a live server)",
            "framework/lmdeploy_ext/patches/forward_failures.py, at each forward step"),
    Setting("DLINFER_RAY_STEP_CHANNEL", "1", "0: LMDeploy's Ray executor sends each step by object-store put "
            "and actor calls, as LMDeploy does, instead of over a TCP connection to each rank",
            "framework/lmdeploy_ext/ray_steps.py, at a Ray engine's first step"),
    Setting("DLINFER_THREADS_PER_RANK", "cores / tp", "compute threads of each tensor-parallel rank on one machine",
            "framework/lmdeploy_ext/patches/mp_executor.py, when the ranks start"),
    # op tools
    Setting("DLINFER_OP_CAPTURE", "off", "a directory: save every op call there ({pid} is replaced)",
            "tools/env.py, at the first op"),
    Setting("DLINFER_OP_CAPTURE_BYTES", "the capture's default", "stop capturing after this many bytes (500M, 2G)",
            "tools/env.py, at the first op"),
    Setting("DLINFER_OP_CAPTURE_KV", "blocks", "how KV caches are saved: blocks (the blocks a call reads) or full",
            "tools/env.py, at the first op"),
    Setting("DLINFER_OP_CAPTURE_LIMIT", "the capture's default", "calls to save per op", "tools/env.py, at the "
            "first op"),
    Setting("DLINFER_OP_CAPTURE_OPS", "every op", "comma-separated ops to capture", "tools/env.py, at the first op"),
    Setting("DLINFER_OP_CAPTURE_SKIP", "0", "calls to skip before capturing", "tools/env.py, at the first op"),
    Setting("DLINFER_OP_COMPARE", "off", "1: check every op call against the torch vendor in float64",
            "tools/env.py, at the first op"),
    Setting("DLINFER_OP_COMPARE_DUMP", "none", "a directory for the inputs of calls that differ", "tools/env.py, at "
            "the first op"),
    Setting("DLINFER_OP_COMPARE_OPS", "every op", "comma-separated ops to compare", "tools/env.py, at the first op"),
    Setting("DLINFER_OP_TIMING", "off", "1: time every op call and print a table at exit", "tools/env.py, at the "
            "first op"),
    Setting("DLINFER_OP_OVERFLOW", "off", "1: name the first op call that writes NaN/inf; raise: also raise",
            "tools/env.py, at the first op"),
)
BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The variable's value with surrounding blanks removed, or None when it is unset or blank. A
    name missing from SETTINGS is a KeyError: every variable dlinfer reads is listed above."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not a dlinfer setting (dlinfer/envs.py lists them)")
    value = (os.environ if environ is None else environ).get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def effective(environ: Optional[Mapping[str, str]] = None) -> List[Tuple[str, str, bool]]:
    """(name, value, set): every setting with its value in this environment, or its default in
    words when unset; set says which. Values are not checked here (the reading module does)."""
    out = []
    for s in SETTINGS:
        value = get(s.name, environ)
        out.append((s.name, value if value is not None else s.default, value is not None))
    return out


def unknown(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """DLINFER_* variables set in this environment that dlinfer does not read (typos, old names)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("DLINFER_") and k not in BY_NAME)
