"""The `chat` and `bench` commands' option checks that need no LMDeploy, and the names of the
device types dlinfer's LMDeploy adaptor adds.

The adaptor defines the device types (lmdeploy_ext/devices/specs.py, `DEVICES`), and the commands
live in it, but importing it patches LMDeploy and takes seconds: `python -m dlinfer chat|bench`
run these checks first (dlinfer/__main__.py), so that a typo in an option or a MODEL that is not a
folder is refused at once. The commands' own `main` runs them again (they are idempotent), for
callers that skip `__main__`. tests/lmdeploy/test_patching.py checks that the device lists agree.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Tuple

DEVICE_TYPES = ("cpu", "dlinfer_cuda")


def check_device(device: str) -> None:
    """ValueError naming the option unless `device` is one of DEVICE_TYPES."""
    if device not in DEVICE_TYPES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DEVICE_TYPES)}")


def check_chat_options(args: argparse.Namespace) -> None:
    """`chat`'s device and MODEL folder (user-expanded in place); ValueError naming the problem."""
    from dlinfer.utils.model_folder import check_model_folder

    args.model = os.path.expanduser(args.model)
    check_device(args.device)
    check_model_folder(args.model)


def _ints(text: str, what: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{what} {text!r}: expected comma-separated integers >= 1")
    return values


def check_bench_options(args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    """(modes, dtypes) of the options, after every check that needs no LMDeploy (the device's name,
    the lists' formats, the model folder): run before the adaptor's import, so that a typo is
    refused in a fraction of a second. ValueError naming the option otherwise."""
    from dlinfer.utils.model_folder import check_model_folder

    args.model = os.path.expanduser(args.model)
    check_device(args.device)
    modes = [m for m in args.mode.split(",") if m]
    if not modes or any(m not in ("eager", "graph") for m in modes):
        raise ValueError(f"--mode {args.mode!r}: expected eager, graph or eager,graph")
    dtypes = [d for d in args.dtype.split(",") if d]
    args.batch = _ints(args.batch, "--batch") if isinstance(args.batch, str) else args.batch
    args.prompt_lengths = (_ints(args.prompt_lengths, "--prompt-lengths") if isinstance(args.prompt_lengths, str)
                           else args.prompt_lengths)
    if args.new_tokens < 2 or args.repeats < 1:
        raise ValueError(f"--new-tokens >= 2 and --repeats >= 1, got {args.new_tokens} and {args.repeats}")
    check_model_folder(args.model)
    return modes, dtypes
