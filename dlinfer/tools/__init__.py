"""Op tools for vendor authors (docs/tools.md): capture, replay, compare, timing, overflow.

Each works in any process with no code change, through environment variables (DLINFER_OP_*,
read when the first op resolves: `dlinfer/tools/env.py`), and as a context manager:

    with dlinfer.tools.capture("/tmp/ops"): ...         # then: python -m dlinfer replay /tmp/ops
    with dlinfer.tools.timing() as t: ...; print(t.table())
    with dlinfer.tools.compare() as c: ...; c.reports   # vs the torch vendor in float64
    with dlinfer.tools.overflow() as o: ...; o.first    # the first call that wrote NaN/inf

While no tool is active the ops resolve to the vendors' own functions: nothing is wrapped.
Layering: this package sits between dlinfer.vendor (which it hooks through
`selection.set_interceptor`) and dlinfer.ops (which reads the environment variables through it).
"""

from dlinfer.tools._hook import OpToolAlarm, Tool, active
from dlinfer.tools.capture import Capture
from dlinfer.tools.compare import Compare
from dlinfer.tools.overflow import NonFiniteOutputError, Overflow
from dlinfer.tools.timing import Timing

capture = Capture
compare = Compare
timing = Timing
overflow = Overflow


def timing_table() -> str:
    """The table of the timing tool started by DLINFER_OP_TIMING=1 (or of the last active one)."""
    from dlinfer.tools.env import env_tool

    tool = env_tool(Timing) or next((t for t in reversed(active()) if isinstance(t, Timing)), None)
    return tool.table() if tool is not None else "dlinfer op timing: not running (DLINFER_OP_TIMING=1)"


def replay(directory, vendor=None, **kwargs):
    """Rerun a capture on `vendor` (a name, a Vendor, or None for the active one); see
    `dlinfer.tools.replayer.replay`."""
    from dlinfer.tools.replayer import replay as _replay

    return _replay(directory, vendor, **kwargs)


__all__ = ["capture", "compare", "timing", "overflow", "replay", "timing_table", "active", "Tool", "Capture",
           "Compare", "Timing", "Overflow", "NonFiniteOutputError", "OpToolAlarm"]
