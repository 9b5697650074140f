"""`python -m dlinfer serve MODEL [options]`: LMDeploy's OpenAI-compatible server on a dlinfer device.

The options are `lmdeploy serve api_server`'s own: LMDeploy 0.18's parser
(`lmdeploy/cli/serve.py:SubCliServe.add_parser_api_server`), so every option it has works and
means what LMDeploy's documentation says, with these changes for dlinfer's device types:

- `--device`: dlinfer's device types (`devices/specs.py`), default "cpu";
- `--backend`: "pytorch" only (TurboMind is LMDeploy's CUDA engine);
- `--dtype`: also float32 (what `dtype="auto"` keeps for a float32 checkpoint on cpu);
- `--cache-max-entry-count`, `--max-prefill-token-num`: default to the device's defaults
  (`DeviceSpec`; cpu: 0.1 of the free RAM, 512 tokens per prefill step) instead of LMDeploy's
  GPU values (0.8, 8192).

The parsed options then go to LMDeploy's own `SubCliServe.api_server`, which builds the
`PytorchEngineConfig` and runs `serve/openai/api_server.py:serve` exactly as
`lmdeploy serve api_server` does: FastAPI + uvicorn in this process, the engine in a child
process started with multiprocessing spawn (`enable_mp_engine=True`). That child imports the
adaptor through its entry point (`patches/mp_engine.py`), and exits when this process is gone.
With `--tp N` that engine process runs LMDeploy's multi-process executor, one process per rank
(`patches/mp_executor.py`). A setting the device cannot run is one line on stderr and exit
status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import dlinfer.framework.lmdeploy_ext  # noqa: F401  (patches LMDeploy in this process)
from dlinfer import envs
from dlinfer.framework.lmdeploy_ext import devices

PROG = "python -m dlinfer serve"
DEFAULT_DEVICE = "cpu"


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def build_parser() -> argparse.ArgumentParser:
    """LMDeploy's `serve api_server` parser, with the dlinfer changes listed in this module's doc."""
    from lmdeploy.cli.serve import SubCliServe

    if "api_server" not in SubCliServe.subparsers.choices:
        SubCliServe.add_parser_api_server()
    parser = SubCliServe.subparsers.choices["api_server"]
    parser.prog = PROG
    parser.description = ("Serve a model with LMDeploy's OpenAI-compatible API server on a dlinfer device type "
                          "(the options are `lmdeploy serve api_server`'s).")

    device = _action(parser, "device")
    device.choices, device.default = list(devices.DEVICES), DEFAULT_DEVICE
    device.help = "dlinfer device type to run the engine on"
    backend = _action(parser, "backend")
    backend.choices, backend.default = ["pytorch"], "pytorch"
    backend.help = "inference engine (LMDeploy's PyTorch engine; TurboMind is CUDA-only)"
    dtype = _action(parser, "dtype")
    dtype.choices = list(dict.fromkeys([*dtype.choices, *(d for spec in devices.DEVICES.values()
                                                          for d in spec.dtypes)]))
    dtype.help = ("data type of weights and activations; 'auto' keeps a float32 or bfloat16 checkpoint's dtype "
                  "on cpu (see docs/lmdeploy.md); the device refuses a dtype it cannot run")
    defaults = ", ".join(f"{s.device_type}: {s.cache_max_entry_count or 0.8}" for s in devices.DEVICES.values())
    entry = _action(parser, "cache_max_entry_count")
    entry.default = None
    entry.help = f"share of the free memory after the weights taken by the KV cache (default: the device's, {defaults})"
    defaults = ", ".join(f"{s.device_type}: {s.max_prefill_token_num or 8192}" for s in devices.DEVICES.values())
    prefill = _action(parser, "max_prefill_token_num")
    prefill.default = None
    prefill.help = ("tokens per prefill step; longer prompts are prefilled in chunks "
                    f"(default: the device's, {defaults})")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    # What LMDeploy's entry point (`lmdeploy/cli/entrypoint.py:run`) does before any subcommand.
    args.model_name = args.model_name or args.model_path
    return args


def check_model_here(args: argparse.Namespace) -> None:
    """The device's model check (backend/model_support.py) in this process, before LMDeploy's
    server starts: the engine runs in a child process, where a refused model would end in a
    traceback there and another here (the engine process died); this way it is one line."""
    from lmdeploy.pytorch.config import ModelConfig

    from dlinfer.framework.lmdeploy_ext.backend.model_support import check_model

    spec = devices.spec_for(args.device)
    if spec is not None:
        check_model(ModelConfig.from_pretrained(args.model_path, trust_remote_code=True), spec)


SHUTDOWN_ENV = "DLINFER_SERVE_SHUTDOWN_S"


def shutdown_seconds() -> float:
    """DLINFER_SERVE_SHUTDOWN_S (default 30): how long in-flight requests may run after SIGTERM."""
    raw = envs.get(SHUTDOWN_ENV) or "30"
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{SHUTDOWN_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


MAX_BODY_ENV = "DLINFER_SERVE_MAX_BODY"


def max_body_bytes() -> int:
    """DLINFER_SERVE_MAX_BODY (default 64M): the largest request body the server reads."""
    from dlinfer.tools.env import parse_size

    raw = envs.get(MAX_BODY_ENV) or "64M"
    value = parse_size(raw, MAX_BODY_ENV)
    if value <= 0:
        raise ValueError(f"{MAX_BODY_ENV}={raw!r}: expected a size above 0, such as 64M")
    return value


@contextlib.contextmanager
def server_limits(shutdown_s: float, max_body: int, cpu: bool = True):
    """While inside, `uvicorn.run` (which LMDeploy's api_server calls with neither) serves its app
    behind `body_limit.BodyLimit(max_body)` and with `timeout_graceful_shutdown=shutdown_s`: without
    the latter SIGTERM waited for every in-flight generation (76 s seen); with it uvicorn cancels
    what still runs after `shutdown_s` and the lifespan's shutdown closes the engine. On a CPU
    device type (`cpu`) /sleep?level=2 is refused too (`sleep_levels.py`)."""
    import uvicorn

    from dlinfer.framework.lmdeploy_ext.body_limit import BodyLimit
    from dlinfer.framework.lmdeploy_ext.sleep_levels import RefuseLevel2Sleep

    original = uvicorn.run

    @functools.wraps(original)
    def run(app, *args, **kwargs):
        kwargs.setdefault("timeout_graceful_shutdown", shutdown_s)
        return original(BodyLimit(RefuseLevel2Sleep(app) if cpu else app, max_body), *args, **kwargs)

    uvicorn.run = run
    try:
        yield
    finally:
        uvicorn.run = original


def main(argv=None) -> int:
    """Run the server until it is stopped (SIGINT/SIGTERM): 0 then; 2 (one line on stderr) for a
    MODEL that is not a loadable folder, a setting or model the device cannot run, or a bad
    DLINFER_SERVE_* value; 3 when the engine process dies under it (patches/mp_engine.py)."""
    from lmdeploy.cli.serve import SubCliServe

    from dlinfer.framework.lmdeploy_ext.patches import image_checks, mp_engine
    from dlinfer.utils.model_folder import check_model_folder

    args = parse_args(argv)
    args.model_path = os.path.expanduser(args.model_path)
    if not os.path.exists(args.model_path) and not args.model_path.startswith(("/", ".", "~")):
        from lmdeploy.utils import get_model

        try:  # a hub id: LMDeploy fetches it (offline, its error is one line here)
            args.model_path = get_model(args.model_path, download_dir=args.download_dir, revision=args.revision)
        except Exception as exc:  # noqa: BLE001 (the hub client's errors have no common base)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"{PROG}: error: MODEL {args.model_path!r} is not a local folder, and fetching it as a model id "
                  f"failed: {first}", file=sys.stderr)
            return 2
    try:
        check_model_folder(args.model_path)
        check_model_here(args)
        spec = devices.spec_for(args.device)
        on_cpu = spec is not None and spec.torch_device == "cpu"
        limits = server_limits(shutdown_seconds(), max_body_bytes(), cpu=on_cpu)
        mp_engine.exit_on_engine_death(True)  # a dead engine ends the server (status 3), for its supervisor
        image_checks.refuse_local_files()  # a remote client names no file on this machine
        with limits:
            SubCliServe.api_server(args)
    except ValueError as exc:  # the config checks (patches/engine_config.py), the model check
        if args.log_level.upper() == "DEBUG":
            raise
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        mp_engine.exit_on_engine_death(False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
