"""DLINFER_OP_TIMING=1 / `dlinfer.tools.timing()`: wall time of each op's vendor function,
summed per op and vendor, as a table (printed at exit when started from the environment;
`table()` at any time).

Only the vendor function is timed (not the argument checks of `dlinfer.ops`, nor other tools).
On CUDA the device is synchronised before and after each call, so each call's kernels are
charged to it: this serialises the host and the device, so totals exceed an unprofiled run's.
"""

from __future__ import annotations

from typing import Dict, Tuple

from dlinfer.tools._hook import Call, Tool


class Timing(Tool):
    """Per (op, vendor): calls and total seconds of the vendor function."""

    name = "timing"
    sync = True

    def __init__(self, ops=None):
        super().__init__(ops)
        self.totals: Dict[Tuple[str, str], list] = {}  # (op, vendor) -> [calls, seconds]

    def after(self, call: Call, result, state) -> None:
        with self.lock:
            entry = self.totals.setdefault((call.op, call.vendor), [0, 0.0])
            entry[0] += 1
            entry[1] += call.seconds

    def reset(self) -> None:
        with self.lock:
            self.totals.clear()

    def rows(self) -> list:
        """[(op, vendor, calls, total s, mean s, share)] by total time, largest first."""
        with self.lock:
            items = [(op, vendor, n, s) for (op, vendor), (n, s) in self.totals.items()]
        grand = sum(s for *_, s in items) or 1.0
        items.sort(key=lambda r: -r[3])
        return [(op, vendor, n, s, s / n, s / grand) for op, vendor, n, s in items]

    def table(self) -> str:
        rows = self.rows()
        if not rows:
            return "dlinfer op timing: no op calls"
        lines = [f"{'op':<26}{'vendor':<9}{'calls':>8}{'total ms':>12}{'mean us':>11}{'share':>8}"]
        for op, vendor, n, total, mean, share in rows:
            lines.append(f"{op:<26}{vendor:<9}{n:>8}{total * 1e3:>12.1f}{mean * 1e6:>11.1f}{share * 100:>7.1f}%")
        calls = sum(r[2] for r in rows)
        total = sum(r[3] for r in rows)
        lines.append(f"{'all ops':<35}{calls:>8}{total * 1e3:>12.1f}")
        return "\n".join(lines)

    def summary(self) -> str:
        return "[dlinfer timing] vendor functions' wall time per op:\n" + self.table()
