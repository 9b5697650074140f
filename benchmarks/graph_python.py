"""How much of a compiled decode graph's time is its own Python: the graph called as it is, against
the same graph with every dlinfer kernel replaced by a stub that hands back the output the real
kernel gave on a recording call (in call order), alternated in one process.

    .venv/bin/python benchmarks/graph_python.py                                # SmolLM2, graph-bf16
    .venv/bin/python benchmarks/graph_python.py --side graph --evict 128         # float32, caches cold

The stubbed call runs everything the graph runs besides the kernels: the generated forward's
lines, the views and splits between the kernels, the embedding and rotary tables, the tuple items,
and the frees of the intermediates (a stub adds a Python call and a `next`). That is about what a
decode step calling the kernels from C++, without Python in between, would save, measured with the
graph's code and data hot in the caches (in a real step they are not: docs/notes/
decode-step-overheads.md); `--evict MB` reads that many MB of another buffer before every timed
call, on both sides, as a step's weights do between two steps. The bound kernels' own
Python-to-C++ crossing (~1 us a call: benchmarks/bench_call_overhead.py) stays inside the kernel
side here.

The graph is the one LMDeploy replays (graph_mode/replay.py, `GraphReplay`) for the decode bucket
of `--batch` prompts (default 1), with the inputs of its first replayed call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def capture_first_replay(side: str, folder: Path, quant: dict, batch: int = 1):
    """(the compiled graph callable, its positional inputs) of the first graph replay of a
    generation of `batch` prompts on `side`, and the side's owner (close it when done)."""
    from e2e_cpu import chat_prompts
    from e2e_sides import make_side

    from dlinfer.framework.lmdeploy_ext.graph_mode import replay

    captured = []
    original = replay.GraphReplay.__call__

    def recording_call(self, kwargs, model):
        if captured or kwargs["input_ids"].shape[-1] < batch:  # [1, bucket] token ids
            return original(self, kwargs, model)
        compiled = self._compiled

        def record(*args):
            captured.append((compiled, args))
            return compiled(*args)

        self._compiled = record
        try:
            return original(self, kwargs, model)
        finally:
            self._compiled = compiled

    replay.GraphReplay.__call__ = recording_call
    try:
        run, owner = make_side(side, folder, chat_prompts(folder), quant)
        run(batch, 8)
    finally:
        replay.GraphReplay.__call__ = original
    if not captured:
        owner.close()
        raise SystemExit(f"{side}: no graph was replayed (not a graph side?)")
    return captured[0][0], captured[0][1], owner


def kernel_names(graph_globals: dict) -> list:
    """The names under which the generated forward finds its dlinfer kernels (bound or not)."""
    return [name for name, value in graph_globals.items() if name.startswith("dlinfer") and callable(value)]


def measure(graph, args, rounds: int, calls: int, evict_mb: int = 0) -> list:
    """[(as is: min, median ms), (stubbed: min, median ms), kernel calls] per round; evict_mb: MB read
    (untimed) before every timed call."""
    import torch

    evict = torch.ones(evict_mb * 2**20 // 4) if evict_mb else None
    flush = (lambda: float(evict.sum())) if evict is not None else (lambda: None)
    inner = graph.graph_for(*args) if hasattr(graph, "graph_for") else graph  # a graph compiled per batch size
    fn = getattr(inner, "__func__", inner)
    scope = fn.__globals__
    names = kernel_names(scope)
    real = {name: scope[name] for name in names}
    outputs, replaying = [], [None]

    def stub(name):
        kernel = real[name]

        def call(*a, **kw):
            if replaying[0] is None:  # recording
                out = kernel(*a, **kw)
                outputs.append(out)
                return out
            return next(replaying[0])

        return call

    def timed(before) -> tuple:
        times = []
        for _ in range(calls):
            before()
            start = time.perf_counter()
            graph(*args)
            times.append(time.perf_counter() - start)
        return min(times) * 1e3, statistics.median(times) * 1e3

    results = []
    try:
        for _ in range(3):
            graph(*args)  # warm
        for _ in range(rounds):
            scope.update(real)
            as_is = timed(flush)
            scope.update({name: stub(name) for name in names})
            outputs.clear()
            replaying[0] = None
            graph(*args)
            stubbed = timed(lambda: (flush(), replaying.__setitem__(0, iter(outputs))))
            results.append((as_is, stubbed, len(outputs)))
    finally:
        scope.update(real)
    return results


def main(argv=None) -> int:
    from e2e_sides import add_w4_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", default="graph-bf16", help="a graph side of benchmarks/e2e_sides.py")
    parser.add_argument("--model", default="", help="an HF folder (default: SmolLM2-135M-Instruct, built if missing)")
    parser.add_argument("--batch", type=int, default=1, help="prompts a step: the bucket whose graph is timed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50, help="graph calls per side and round")
    parser.add_argument("--evict", type=int, default=0, metavar="MB",
                        help="read this many MB of another buffer before every timed call (default 0: none)")
    add_w4_arguments(parser)
    args = parser.parse_args(argv)
    from smollm2 import build_smollm2

    folder = Path(args.model) if args.model else build_smollm2(log=lambda msg: print(msg, file=sys.stderr))
    graph, inputs, owner = capture_first_replay(args.side, folder,
                                                {"group_size": args.group_size, "w4_method": args.w4_method},
                                                args.batch)
    try:
        results = measure(graph, inputs, args.rounds, args.calls, args.evict)
    finally:
        owner.close()
    evicted = f", {args.evict} MB read before each call" if args.evict else ""
    print(f"{args.side}, {folder.name}, batch {args.batch}: one decode graph call, ms (min / median of "
          f"{args.calls} calls a round{evicted})")
    print("| round | as is | kernels stubbed | kernel calls | stubbed / as is (min) |")
    print("|---|---|---|---|---|")
    for i, (as_is, stubbed, calls) in enumerate(results, 1):
        print(f"| {i} | {as_is[0]:.3f} / {as_is[1]:.3f} | {stubbed[0]:.3f} / {stubbed[1]:.3f} | {calls} | "
              f"{stubbed[0] / as_is[0]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
