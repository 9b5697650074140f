"""The tools' environment variables, read once, when the first op resolves (the op layer
registers `from_env` with `dlinfer.vendor.selection.on_first_resolve`), like DLINFER_VENDOR.

DLINFER_OP_CAPTURE=DIR          capture every call under DIR ("{pid}" in DIR becomes the process id)
DLINFER_OP_CAPTURE_LIMIT=N      at most N calls (default 10000; 0: no limit)
DLINFER_OP_CAPTURE_BYTES=SIZE   at most SIZE bytes, e.g. 500M, 4G (default 2G; 0: no limit)
DLINFER_OP_CAPTURE_OPS=a,b:N    only these ops (b: at most N calls)
DLINFER_OP_CAPTURE_SKIP=N       leave out the first N calls (an engine's warm-up)
DLINFER_OP_CAPTURE_KV=full      whole KV caches in every call (default: the blocks it touches)
DLINFER_OP_COMPARE=1            rerun every call on the torch vendor in float64, report the first
                                call of each op out of tolerance
DLINFER_OP_COMPARE_OPS=a,b      only these ops
DLINFER_OP_COMPARE_DUMP=DIR     where those calls are dumped (default: $TMPDIR/dlinfer-compare-<pid>)
DLINFER_OP_TIMING=1             per-op time table, printed at exit
DLINFER_OP_OVERFLOW=1|raise     NaN/inf checks on every call's outputs (raise: stop at the first)

Tools started here stop at interpreter exit and print their summaries on stderr. A bad value
raises ValueError naming the variable (at the first op call).
"""

from __future__ import annotations

import atexit
import os
import re
from typing import List, Optional

from dlinfer import envs
from dlinfer.tools._hook import Tool

_started: List[Tool] = []
_OFF = ("", "0", "false", "False", "off", "no")


def _flag(name: str) -> Optional[str]:
    value = envs.get(name) or ""
    return None if value in _OFF else value


def parse_size(text: str, name: str = "size") -> int:
    """'2G', '500M', '64k', '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"{name}={text!r}: expected a size such as 500M or 2G")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _int(name: str, default: int) -> int:
    raw = envs.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number >= 0")
    return value


def tools_from_env() -> List[Tool]:
    """The tools the environment asks for (not started)."""
    from dlinfer.tools.capture import DEFAULT_BYTES, DEFAULT_LIMIT, Capture
    from dlinfer.tools.compare import Compare
    from dlinfer.tools.overflow import Overflow
    from dlinfer.tools.timing import Timing

    tools: List[Tool] = []
    directory = envs.get("DLINFER_OP_CAPTURE")
    if directory:
        raw_bytes = envs.get("DLINFER_OP_CAPTURE_BYTES")
        max_bytes = parse_size(raw_bytes, "DLINFER_OP_CAPTURE_BYTES") if raw_bytes else DEFAULT_BYTES
        kv = envs.get("DLINFER_OP_CAPTURE_KV") or "blocks"
        ops = envs.get("DLINFER_OP_CAPTURE_OPS")
        try:
            cap = Capture(directory.replace("{pid}", str(os.getpid())), limit=_int("DLINFER_OP_CAPTURE_LIMIT",
                          DEFAULT_LIMIT), max_bytes=max_bytes, ops=ops, kv=kv,
                          skip=_int("DLINFER_OP_CAPTURE_SKIP", 0))
        except ValueError as exc:
            raise ValueError(f"DLINFER_OP_CAPTURE_OPS / DLINFER_OP_CAPTURE_KV: {exc}") from None
        cap.env_names = {"limit": "DLINFER_OP_CAPTURE_LIMIT", "bytes": "DLINFER_OP_CAPTURE_BYTES",
                         "op": "DLINFER_OP_CAPTURE_OPS"}
        tools.append(cap)
    if _flag("DLINFER_OP_COMPARE"):
        ops = [o for o in (envs.get("DLINFER_OP_COMPARE_OPS") or "").split(",") if o.strip()] or None
        try:
            tools.append(Compare(ops=None if ops is None else [o.strip() for o in ops],
                                 dump_dir=envs.get("DLINFER_OP_COMPARE_DUMP")))
        except ValueError as exc:
            raise ValueError(f"DLINFER_OP_COMPARE_OPS: {exc}") from None
    if _flag("DLINFER_OP_TIMING"):
        tools.append(Timing())
    overflow = _flag("DLINFER_OP_OVERFLOW")
    if overflow:
        if overflow not in ("1", "true", "True", "on", "yes", "raise"):
            raise ValueError(f"DLINFER_OP_OVERFLOW={overflow!r}: expected 1 or raise")
        tools.append(Overflow(raise_=overflow == "raise"))
    return tools


def from_env() -> None:
    """Start the tools the environment asks for; they stop (printing their summaries) at exit."""
    tools = tools_from_env()
    for tool in tools:
        tool.verbose = True
        tool.start()
        _started.append(tool)
    if tools:
        atexit.register(stop_env_tools)


def stop_env_tools() -> None:
    """Stop the tools started from the environment (at exit; callable earlier)."""
    while _started:
        _started.pop(0).stop()


def env_tool(kind: type) -> Optional[Tool]:
    """The running tool of class `kind` started from the environment, if any."""
    return next((t for t in _started if isinstance(t, kind)), None)
