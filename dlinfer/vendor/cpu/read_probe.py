"""The read-bandwidth probe: the best sustained rate at which this machine's cores read memory.

Every weight-streaming kernel (a decode step reads each weight once) is measured against it, not
against a torch sum (which reads one stream per thread, unrolled for arithmetic, not for memory:
on the Zen 5 VM ~40 GB/s where a plain AVX-512 read loop reads 57-72). The probe is a C++ loop
that does nothing but read (csrc/read_probe.cpp): each thread a contiguous band of a buffer larger
than twice the last-level cache, `streams` sequential streams per thread, an optional software
prefetch. `ReadProbe.explore` searches the parameters that decide how fast such a loop reads:
threads, streams per thread, prefetch distance and cache level, and the page size (2 MB pages, as
the engine's weights get, or 4 KB pages); `ReadProbe.measure` reads once with the best found.

The machine's bandwidth drifts (docs/design.md, "The read-bandwidth probe"): a benchmark measures
the probe interleaved with the kernel under test, in the same process, alternating, several
rounds, and reports both sides' min and median (benchmarks/bench_weight_stream.py).
`python -m dlinfer env` prints a quick exploration's result.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

GIB = 1 << 30
STREAMS = (1, 2, 4, 8)
PREFETCH = ((0, 0), (1024, 0), (4096, 0), (4096, 1), (16384, 1))  # (bytes ahead, 0: into L1 / 1: into L2)


class Config(NamedTuple):
    threads: int
    streams: int
    prefetch_bytes: int
    hint: int  # 0: prefetch into L1, 1: into L2 (no meaning without a prefetch)
    huge_pages: bool

    def describe(self) -> str:
        prefetch = "no prefetch" if not self.prefetch_bytes else (
            f"prefetch {self.prefetch_bytes // 1024} KB ahead into {'L1' if self.hint == 0 else 'L2'}")
        pages = "2 MB pages" if self.huge_pages else "4 KB pages"
        return f"{self.threads} threads x {self.streams} streams, {prefetch}, {pages}"


class Exploration(NamedTuple):
    """best: the configuration whose median rate was highest; rate: that median (bytes/s);
    rates: every configuration tried -> its median (bytes/s); problem: why the 2 MB-page buffer
    is not (all) on huge pages, or None."""
    best: Config
    rate: float
    rates: Dict[Config, float]
    problem: Optional[str]


def buffer_bytes() -> int:
    """The probe's buffer size: 1 GiB, or twice the last-level cache if that is larger (so that
    reads come from memory, not the cache), a multiple of 2 MB."""
    from dlinfer.utils import machine

    llc = machine.last_level_cache_bytes() or 0
    size = max(GIB, 2 * llc)
    return (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)


class ReadProbe:
    """Two buffers of `nbytes` (default `buffer_bytes()`): one on 2 MB pages where the kernel gives
    them (dlinfer/utils/huge_pages.empty_arena), one on 4 KB pages; both written once, so their pages
    exist (an untouched page would read as the shared zero page)."""

    def __init__(self, nbytes: Optional[int] = None):
        import torch

        from dlinfer.utils import huge_pages
        from dlinfer.vendor.cpu import build

        self._read = build.module().read_probe
        self.nbytes = nbytes or buffer_bytes()
        self._huge, problem = huge_pages.empty_arena(self.nbytes)
        self._huge.fill_(1)
        start = self._huge.data_ptr()
        if problem is None:
            backed = huge_pages.huge_bytes(start, start + self.nbytes)
            if backed < self.nbytes - huge_pages.allowed_shortfall(self.nbytes):
                problem = (f"the kernel backed {backed >> 20} of {self.nbytes >> 20} MB with huge pages "
                           f"(THP mode {huge_pages._thp_mode() or 'unknown'})")
        self.huge_pages_problem = problem
        self._small = torch.ones(self.nbytes, dtype=torch.uint8)
        self.max_threads = torch.get_num_threads()
        self.exploration: Optional[Exploration] = None

    def rate(self, config: Config) -> float:
        """Bytes per second of one read of a whole buffer with `config`."""
        buf = self._huge if config.huge_pages else self._small
        start = time.perf_counter()
        self._read(buf, config.threads, config.streams, config.prefetch_bytes, config.hint)
        return self.nbytes / (time.perf_counter() - start)

    def _median(self, config: Config, rounds: int) -> float:
        return statistics.median(self.rate(config) for _ in range(rounds))

    def explore(self, rounds: int = 3, threads: Optional[Sequence[int]] = None) -> Exploration:
        """Coordinate search, each configuration's median over `rounds` reads: threads x streams
        (no prefetch, 2 MB pages), then the prefetch distances and levels on the best of those,
        then the other page size with the best of everything. threads: the counts to try (default:
        this process's torch thread count, and half of it)."""
        counts = sorted(set(threads or (self.max_threads, max(1, self.max_threads // 2))), reverse=True)
        rates: Dict[Config, float] = {}

        def best_of(configs: List[Config]) -> Config:
            for c in configs:
                if c not in rates:
                    rates[c] = self._median(c, rounds)
            return max(configs, key=rates.__getitem__)

        self.rate(Config(counts[0], 1, 0, 0, True))  # warm the pool and both buffers' TLB paths once
        self.rate(Config(counts[0], 1, 0, 0, False))
        best = best_of([Config(t, s, 0, 0, True) for t in counts for s in STREAMS])
        best = best_of([best._replace(prefetch_bytes=p, hint=h) for p, h in PREFETCH])
        best = best_of([best, best._replace(huge_pages=False)])
        self.exploration = Exploration(best, rates[best], rates, self.huge_pages_problem)
        return self.exploration

    def measure(self) -> float:
        """Bytes per second of one read with the best configuration (explored first if need be)."""
        if self.exploration is None:
            self.explore()
        return self.rate(self.exploration.best)

    def keep_best(self) -> None:
        """Free the buffer the best configuration does not read (explored first if need be)."""
        if self.exploration is None:
            self.explore()
        if self.exploration.best.huge_pages:
            self._small = None
        else:
            self._huge = None

    def release(self) -> None:
        """Free both buffers (the probe cannot measure afterwards)."""
        self._huge = self._small = None


def summary(exploration: Exploration) -> str:
    """One line: the best rate and how it was read, the 4 KB-page rate beside it."""
    best = exploration.best
    other = exploration.rates.get(best._replace(huge_pages=not best.huge_pages))
    line = f"{exploration.rate / 1e9:.1f} GB/s ({best.describe()}"
    if other is not None:
        line += f"; {'4 KB' if best.huge_pages else '2 MB'} pages {other / 1e9:.1f} GB/s"
    line += f"; {len(exploration.rates)} configurations tried)"
    if exploration.problem:
        line += f"; huge pages: {exploration.problem}"
    return line
