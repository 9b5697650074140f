"""`python -m dlinfer <command>`. `env`: what a bug report needs (versions, machine, compiler,
vendors, LMDeploy adaptor, devices), every failure reported as a line rather than raised.
`replay DIR`: rerun captured op calls on a vendor (dlinfer/tools/replayer.py, docs/tools.md).
`serve MODEL [...]`: LMDeploy's OpenAI-compatible server on CPU (dlinfer/framework/lmdeploy_ext/serve.py).
`quantize SRC DST --method ...`: AWQ / SmoothQuant checkpoints for LMDeploy (dlinfer/quantize, docs/quantize.md).
`chat MODEL [...]`: a multi-turn chat through LMDeploy on CPU (dlinfer/framework/lmdeploy_ext/chat.py).
`bench MODEL [...]`: decode tokens/s, time to first token, weight GB/s against the read-bandwidth
probe (dlinfer/framework/lmdeploy_ext/bench.py).

Subcommands: one `_cmd_<name>(args) -> int` each, registered in `_build_parser`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import warnings

_NO_COMPILER = "none found: the cpu vendor cannot build its kernels; CPU ops run on the torch vendor"
_MAX_REASON = 300  # characters of a failure's first line


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _one_line(text: object) -> str:
    """The first non-empty line of `text`, cut to _MAX_REASON characters."""
    first = next((line.strip() for line in str(text).splitlines() if line.strip()), "")
    return first if len(first) <= _MAX_REASON else first[:_MAX_REASON] + " ..."


def _error(exc: BaseException) -> str:
    return f"ERROR {type(exc).__name__}: {_one_line(exc)}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _compiler_line() -> str:
    try:
        from dlinfer.vendor.cpu import build

        find_compiler = getattr(build, "find_compiler", None)
        if find_compiler is None:
            return "c++ compiler  unknown (this dlinfer's cpu vendor has no build.find_compiler)"
        found = find_compiler()
    except Exception as exc:
        return f"c++ compiler  {_error(exc)}"
    if found is None:
        return f"c++ compiler  {_NO_COMPILER}"
    path, version = found
    return f"c++ compiler  {path} ({_one_line(version) or 'version unknown'})"


def _machine_lines() -> list:
    import torch

    from dlinfer.utils import machine

    lines = [f"  cpu:          {machine.cpu_model() or 'unknown model'}"]
    try:
        isa = machine.torch_isa()
    except Exception as exc:  # an old torch without get_cpu_capability
        isa = _error(exc)
    flags = machine.cpu_flags()
    flags_text = "unknown (no /proc/cpuinfo)" if flags is None else (" ".join(flags) or "none of " + " ".join(
        machine.RELEVANT_CPU_FLAGS))
    lines.append(f"  isa:          torch {isa}; cpu flags {flags_text}")
    logical, usable = machine.cores()
    usable_text = f" ({usable} usable by this process)" if usable is not None and usable != logical else ""
    lines.append(f"  cores:        {logical if logical is not None else 'unknown'} logical{usable_text}")
    torch_threads, omp = machine.threads()
    omp_text = "OMP_NUM_THREADS unset" if omp is None else f"OMP_NUM_THREADS={omp}"
    lines.append(f"  threads:      torch {torch_threads}, {omp_text}")
    mem = machine.memory()
    lines.append("  ram:          unknown" if mem is None else f"  ram:          {_gib(mem[0])} total, "
                 f"{_gib(mem[1])} available")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i}:       {p.name}, {_gib(p.total_memory)}, sm_{p.major}{p.minor}")
    else:
        lines.append("  cuda:         not available")
    return lines


def _vendor_lines() -> list:
    from dlinfer.vendor import registry, selection
    from dlinfer.vendor.op_table import OP_NAMES

    lines = ["vendors:"]
    for name in registry.known_names():
        vendor = registry.try_load(name)
        if vendor is None:
            lines.append(f"  {name:<10} failed  {_one_line(registry.failures().get(name, '?'))}")
            continue
        extra = ""
        if name == "cpu":
            from dlinfer.vendor.cpu import build

            extra = f" kernels={build.isa()} ({build.module_name()})"
        lines.append(f"  {name:<10} ok      devices={','.join(vendor.device_types)} "
                     f"kv_layouts={','.join(vendor.kv_layouts)} ops={len(vendor.ops)}/{len(OP_NAMES)}{extra}")
        if name == "cpu":
            lines.append(_w4_activations_line())
    try:
        with warnings.catch_warnings():  # the lines above already say which vendor failed and why
            warnings.filterwarnings("ignore", message="dlinfer: vendor .* cannot load")
            lines.append(f"active vendor: {selection.current().name} (kv layout {selection.kv_layout()})")
    except Exception as exc:  # report, don't crash: this is the bug-report command
        lines.append(f"active vendor: {_error(exc)}")
    if os.environ.get("TRITON_INTERPRET"):
        lines.append(f"  TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}")
    return lines


def _w4_activations_line() -> str:
    """What the cpu vendor's W4 kernels do with each activation dtype under this process's
    DLINFER_CPU_W4_ACTIVATIONS (its default, auto, depends on the build: docs/settings.md)."""
    import torch

    from dlinfer.vendor.cpu import weight_quant

    try:
        setting = weight_quant.activations()
        per_dtype = ", ".join(f"{str(d).removeprefix('torch.')} {weight_quant.activations_for(d)}"
                              for d in (torch.bfloat16, torch.float16, torch.float32))
    except ValueError as exc:
        return f"             w4 activations: {_one_line(exc)}"
    return f"             w4 activations ({weight_quant.ACTIVATIONS_ENV}={setting}): {per_dtype}"


def _settings_lines() -> list:
    """Every DLINFER_* setting (dlinfer/envs.py) with its effective value: the one set in this
    environment, or its default (in brackets); set variables dlinfer does not know are named."""
    from dlinfer import envs

    lines = ["settings (docs/settings.md; [default] where unset):"]
    for name, value, is_set in envs.effective():
        lines.append(f"  {name:<26} {value if is_set else '[' + value + ']'}")
    for name in envs.unknown():
        lines.append(f"  {name:<26} {os.environ[name]!r}: NOT a dlinfer setting (a typo? nothing reads it)")
    return lines


def _lmdeploy_lines() -> list:
    """Whether dlinfer's LMDeploy adaptor imports here, and which of its patches are in place.
    Importing the adaptor applies its patches (once), as a user's `import` would."""
    head = "lmdeploy adaptor:"
    version = _version("lmdeploy")
    if version == "not installed":
        return [f"{head} unavailable: LMDeploy is not installed"]
    try:
        import dlinfer.framework.lmdeploy_ext  # noqa: F401
    except Exception as exc:
        gate = sys.modules.get("dlinfer.framework.lmdeploy_ext.version")
        if gate is not None and isinstance(exc, gate.UnsupportedLMDeployVersion):
            return [f"{head} unsupported: {_one_line(exc)}"]
        lines = [f"{head} LMDeploy {version}, importing the adaptor failed: {_error(exc)}"]
    else:
        gate = sys.modules["dlinfer.framework.lmdeploy_ext.version"]
        series = ", ".join(f"{s}.x" for s in gate.SUPPORTED_SERIES)
        lines = [f"{head} LMDeploy {version} supported (dlinfer supports {series})"]
    patches = sys.modules.get("dlinfer.framework.lmdeploy_ext.patches")
    if patches is None:
        return lines + ["  patches: none applied (the adaptor failed before patching)"]
    try:
        status = patches.status()
    except Exception as exc:
        return lines + [f"  patches: {_error(exc)}"]
    complete = [name for name, (done, total) in status.items() if total and done == total]
    lines.append(f"  patches: {len(complete)}/{len(status)} applied")
    for name, (done, total) in status.items():
        state = "applied" if name in complete else "NOT applied"
        lines.append(f"    {name:<17} {state} ({done}/{total} attributes replaced)")
    return lines


def _read_bandwidth_lines() -> list:
    """The read-bandwidth probe's best rate (dlinfer/vendor/cpu/read_probe.py): a few seconds and
    two buffers of 1 GiB (or twice the last-level cache); skipped with a reason when the cpu vendor
    cannot load or RAM is short."""
    from dlinfer.utils import machine
    from dlinfer.vendor import registry

    if registry.try_load("cpu") is None:
        return ["  read bw:      unavailable (the cpu vendor's kernels, which hold the probe, did not load)"]
    from dlinfer.vendor.cpu import read_probe

    need = 3 * read_probe.buffer_bytes()
    mem = machine.memory()
    if mem is not None and mem[1] < need:
        return [f"  read bw:      not measured: the probe needs {_gib(need)} free, {_gib(mem[1])} available"]
    probe = read_probe.ReadProbe()
    try:
        exploration = probe.explore(rounds=2)
    finally:
        probe.release()
    return [f"  read bw:      {read_probe.summary(exploration)}"]


def _section(build) -> list:
    """`build()`'s lines, or one error line: one broken section must not hide the others."""
    try:
        return build()
    except Exception as exc:
        return [f"  {build.__name__.strip('_')}: {_error(exc)}"]


def env_report(probe: bool = True) -> str:
    """The report; probe: also measure the read bandwidth (a few seconds)."""
    import dlinfer

    lines = [
        f"dlinfer       {dlinfer.__version__}",
        f"python        {platform.python_version()} ({sys.executable})",
        f"platform      {platform.platform()}",
    ]
    for dist in ("torch", "triton", "lmdeploy", "transformers", "ninja"):
        lines.append(f"{dist:<13} {_version(dist)}")
    lines.append(_compiler_line())
    lines += ["", "devices:", *_section(_machine_lines)]
    if probe:
        lines += _section(_read_bandwidth_lines)
    lines += ["", *_section(_vendor_lines)]
    lines += ["", *_section(_settings_lines)]
    lines += ["", *_section(_lmdeploy_lines)]
    return "\n".join(lines)


def _cmd_env(args: argparse.Namespace) -> int:
    print(env_report(probe=not args.no_probe))
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from dlinfer.conformance import cli

    return cli.main(args)


def _cmd_replay(args: argparse.Namespace) -> int:
    from dlinfer.tools import replayer

    return replayer.main(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from dlinfer.framework.lmdeploy_ext import serve

    return serve.main(args.argv)


def _refused(command: str, check, args: argparse.Namespace) -> bool:
    """Whether `check(args)` (lmdeploy_options: no LMDeploy needed) refuses the options, said in one
    line on stderr: before the command's module imports the LMDeploy adaptor (seconds)."""
    try:
        check(args)
    except ValueError as exc:
        print(f"python -m dlinfer {command}: error: {exc}", file=sys.stderr)
        return True
    return False


def _cmd_chat(args: argparse.Namespace) -> int:
    from dlinfer.framework import lmdeploy_options

    if _refused("chat", lmdeploy_options.check_chat_options, args):
        return 2
    from dlinfer.framework.lmdeploy_ext import chat

    return chat.main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from dlinfer.framework import lmdeploy_options

    if _refused("bench", lmdeploy_options.check_bench_options, args):
        return 2
    from dlinfer.framework.lmdeploy_ext import bench

    return bench.main(args)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from dlinfer.quantize import cli

    return cli.main(args)


def _add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """`chat`'s options (here, so that building the parser imports no LMDeploy adaptor)."""
    parser.add_argument("model", help="a local HF model folder (float, AWQ or SmoothQuant)")
    parser.add_argument("--device", default="cpu", help="dlinfer device type (docs/lmdeploy.md; default cpu)")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's float32 or bfloat16 on cpu), "
                                                        "float32, bfloat16 or float16, as the device allows")
    parser.add_argument("--system", default=None, help="a system message that starts the conversation")
    parser.add_argument("--graph", action="store_true",
                        help="compile the decode step (dlinfer's torch.compile backend): faster tokens, "
                             "slower start (one compile per batch bucket)")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="longest answer, in tokens")
    parser.add_argument("--session-len", type=int, default=None,
                        help="longest conversation, in tokens (default: the model's context length)")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench`'s options (here, so that building the parser imports no LMDeploy adaptor)."""
    parser.add_argument("model", help="a local HF model folder (float, AWQ or SmoothQuant)")
    parser.add_argument("--mode", default="graph", help="eager, graph or eager,graph (default graph: compiled "
                                                         "decode steps, as a deployment runs)")
    parser.add_argument("--dtype", default="auto", help="comma-separated dtypes, each its own engine (default auto: "
                                                        "the checkpoint's float32 or bfloat16 on cpu)")
    parser.add_argument("--batch", default="1,8", help="batch sizes of the decode timings (default 1,8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per decode timing (default 64)")
    parser.add_argument("--prompt-lengths", default="32,512",
                        help="prompt lengths of the time-to-first-token timings (default 32,512)")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each kind; the best is kept (default 3)")
    parser.add_argument("--no-probe", action="store_true", help="no read-bandwidth probe (no share column)")
    parser.add_argument("--device", default="cpu", help="dlinfer device type (default cpu)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dlinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print what a bug report needs: versions, machine, compiler, vendors, "
                                     "LMDeploy adaptor")
    env.add_argument("--no-probe", action="store_true",
                     help="skip the read-bandwidth probe (a few seconds, 2 GiB of RAM)")
    env.set_defaults(func=_cmd_env)
    from dlinfer.conformance import cli as conformance_cli

    conformance = sub.add_parser("conformance", help=conformance_cli.HELP + " (docs/conformance.md)")
    conformance_cli.add_arguments(conformance)
    conformance.set_defaults(func=_cmd_conformance)
    from dlinfer.tools import replayer

    replay = sub.add_parser("replay", help="rerun a DLINFER_OP_CAPTURE directory on a vendor, compare and time "
                                           "every call (docs/tools.md)")
    replayer.add_arguments(replay)
    replay.set_defaults(func=_cmd_replay)
    # Every argument after `serve` is LMDeploy's `serve api_server` options (`--help` included),
    # parsed by dlinfer/framework/lmdeploy_ext/serve.py: no prefix chars here, so none is taken.
    serve = sub.add_parser("serve", add_help=False, prefix_chars="\0",
                           help="LMDeploy's OpenAI-compatible API server on CPU: serve MODEL [lmdeploy serve "
                                "api_server options] (docs/lmdeploy.md)")
    serve.add_argument("argv", nargs=argparse.REMAINDER)
    serve.set_defaults(func=_cmd_serve)
    chat = sub.add_parser("chat", help="chat with a model through LMDeploy on CPU: chat MODEL [--system ...] "
                                       "(turns from a terminal or a pipe; docs/lmdeploy.md)")
    _add_chat_arguments(chat)
    chat.set_defaults(func=_cmd_chat)
    bench = sub.add_parser("bench", help="decode tokens/s at batch 1 and N, time to first token, weight GB/s "
                                         "against the read-bandwidth probe: bench MODEL (docs/lmdeploy.md)")
    _add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    from dlinfer.quantize import cli as quantize_cli

    quantize = sub.add_parser("quantize", help=quantize_cli.HELP)
    quantize_cli.add_arguments(quantize)
    quantize.set_defaults(func=_cmd_quantize)
    return parser


def main(argv=None) -> int:
    args = _build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
