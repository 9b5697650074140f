"""Where a decode step's wall time goes, eager and graph mode alike: the model forward (the graph
replay in graph mode), the LM head, and LMDeploy's engine around them, per step, as the minimum
and the median over every decode step of a generation.

    .venv/bin/python benchmarks/step_parts.py                       # eager, graph; batch 1 and 8
    .venv/bin/python benchmarks/step_parts.py --sides graph,graph-bf16 --batches 1 --tokens 256
    .venv/bin/python benchmarks/step_parts.py --sides graph-w8a8 --batches 1 --functions   # + host functions

`benchmarks/e2e_cpu.py`'s op budget times each `dlinfer.ops` call, which only exist in eager mode
(a compiled graph calls the vendor kernels directly); this times what both modes share, at
LMDeploy's own seams: `model_forward` (agent.py: context, inputs, the model or its graph) and
`BaseModelAgent.get_logits` (the LM head), the rest of the interval between two forwards being the
engine (scheduling, inputs, sampling, outputs). The minimum over steps is what a step costs when
nothing else runs on the machine; the median shows the machine's noise. Each side runs in a
process of its own (sides in one process share OpenMP pools, docs/lmdeploy.md "Threads").

`--functions` also times the host-side functions in `FUNCTIONS` (LMDeploy's engine and dlinfer's
adaptor; each wrapped where its caller looks it up) and prints their mean microseconds per decode
step, inclusive of what they call: the engine's part of a step, broken down. The averages include
the prefill step's share (one in `--tokens`).

`--ops` also times every dlinfer op a compiled graph calls (graph sides: each vendor function the
`direct` graph compiler binds a node to, wrapped when it binds it) and prints, per op, the calls and
the mean microseconds per decode step, with the forward's rest (the graph's own Python: views,
casts, embedding, residual adds) as the forward's mean minus those.

The timing wrappers add a frame above the model's forward, which moves where the forward's frames
sit on CPython's data stack: costs that depend on that position (docs/graph.md, "The graph's
frame") can show up in `benchmarks/e2e_cpu.py`'s tokens/s and not here. The end-to-end rate is
the measure; this says where a step's time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

PARTS = ("step", "forward", "LM head", "engine")

# (module, attribute path) of each host function `--functions` times, where its callers look it up.
FUNCTIONS = (
    ("lmdeploy.pytorch.engine.inputs_maker", "InputsMakerAsync._make_forward_inputs"),
    ("lmdeploy.pytorch.engine.inputs_maker", "InputsMakerAsync.create_model_inputs_delta"),
    ("lmdeploy.pytorch.strategies.ar.sampling", "ARSamplingStrategy.make_sampling_inputs"),
    ("lmdeploy.pytorch.engine.logits_process", "FusedLogitsProcessor.sampling"),
    ("lmdeploy.pytorch.engine.engine_loop", "EngineLoop._make_infer_outputs"),
    ("lmdeploy.pytorch.engine.model_agent.agent", "BaseModelAgent._get_inputs_from_delta"),
    ("lmdeploy.pytorch.engine.model_agent.agent", "BatchedOutputs.to_cpu"),
    ("dlinfer.framework.lmdeploy_ext.backend.op_backend", "build_attention_metadata"),
    ("dlinfer.framework.lmdeploy_ext.backend.step_context", "last_token_slots"),
    ("dlinfer.framework.lmdeploy_ext.graph_mode.runner", "DlinferGraphRunner._pad"),
    ("dlinfer.framework.lmdeploy_ext.graph_mode.replay", "GraphReplay.__call__"),
)


def _timed_functions(totals: Counter) -> list:
    """Wrap every FUNCTIONS entry to add its wall seconds to totals[name]; returns the undo list."""
    import importlib

    from e2e_cpu import timed_calls

    undo, calls = [], Counter()
    for module_name, path in FUNCTIONS:
        owner = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        original = getattr(owner, attr)
        setattr(owner, attr, timed_calls(original, totals, calls, path))
        undo.append((owner, attr, original))
    return undo


def _timed_graph_ops(totals: Counter, calls: Counter) -> list:
    """Make the direct graph compiler bind each dlinfer node to a wrapper that adds its wall seconds
    to totals[op] and one to calls[op]; returns the undo list."""
    from e2e_cpu import timed_calls

    from dlinfer.graph import backend

    selection = backend.selection
    resolve = selection.resolve

    class TimedSelection:  # what backend.direct_compiler sees as `selection`
        def __getattr__(self, name):
            return getattr(selection, name)

        @staticmethod
        def resolve(op, device_type):
            fn, vendor = resolve(op, device_type)
            return timed_calls(fn, totals, calls, op), vendor

    backend.selection = TimedSelection()
    return [(backend, "selection", selection)]


def measure(side: str, batch: int, tokens: int, repeats: int, functions: bool = False, ops: bool = False,
            model: str = "", quant: Optional[dict] = None) -> dict:
    """{part: [ms of every decode step]} over `repeats` generations of `tokens` new tokens; with
    `functions`, also "functions": {FUNCTIONS name: mean us per decode step}; with `ops`, also
    "ops": {op: [mean us per decode step, calls per decode step]} (graph sides). quant: the W4A16
    sides' {"group_size", "w4_method"} (e2e_sides.make_side's defaults without it)."""
    import lmdeploy.pytorch.engine.model_agent.agent as agent
    from e2e_cpu import chat_prompts
    from e2e_sides import make_side
    from smollm2 import build_smollm2

    folder = Path(model) if model else build_smollm2(log=lambda msg: print(msg, file=sys.stderr))
    op_totals, op_calls = Counter(), Counter()
    undo_ops = _timed_graph_ops(op_totals, op_calls) if ops else []
    run, owner = make_side(side, folder, chat_prompts(folder), quant or {})
    run(batch, 4)  # warm
    op_totals.clear()  # what compiling and warming called
    op_calls.clear()
    events = []
    forward, logits = agent.model_forward, agent.BaseModelAgent.get_logits

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        events.append(("forward", start, time.perf_counter()))
        return out

    def timed_logits(self, *args, **kwargs):
        start = time.perf_counter()
        out = logits(self, *args, **kwargs)
        events.append(("LM head", start, time.perf_counter()))
        return out

    agent.model_forward, agent.BaseModelAgent.get_logits = timed_forward, timed_logits
    parts = {p: [] for p in PARTS}
    totals: Counter = Counter()
    undo = _timed_functions(totals) if functions else []
    try:
        for _ in range(repeats):
            events.clear()
            run(batch, tokens)
            fwd = [e for e in events if e[0] == "forward"][1:]  # the first is the prefill
            head = [e for e in events if e[0] == "LM head"][1:]
            for i in range(len(fwd) - 1):
                step = fwd[i + 1][1] - fwd[i][1]
                parts["step"].append(step * 1e3)
                parts["forward"].append((fwd[i][2] - fwd[i][1]) * 1e3)
                parts["LM head"].append((head[i][2] - head[i][1]) * 1e3)
                parts["engine"].append((step - (fwd[i][2] - fwd[i][1]) - (head[i][2] - head[i][1])) * 1e3)
    finally:
        agent.model_forward, agent.BaseModelAgent.get_logits = forward, logits
        for target, attr, original in undo + undo_ops:
            setattr(target, attr, original)
        owner.close()
    if functions:
        steps = repeats * tokens
        parts["functions"] = {name: totals.get(name, 0.0) / steps * 1e6 for _, name in FUNCTIONS}
    if ops:  # per generated token: the prefill's calls are in these sums too (one step in `tokens`)
        steps = repeats * tokens
        parts["ops"] = {op: [sec / steps * 1e6, op_calls[op] / steps] for op, sec in op_totals.items()}
    return parts


def main(argv=None) -> int:
    from e2e_sides import add_w4_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="eager,graph", help="sides of benchmarks/e2e_sides.py (LMDeploy ones)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--functions", action="store_true", help="also time FUNCTIONS (us per decode step)")
    parser.add_argument("--model", default="", help="an HF folder (default: SmolLM2-135M-Instruct, built if missing)")
    parser.add_argument("--ops", action="store_true", help="also time each graph op (us per decode step)")
    add_w4_arguments(parser)
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "BATCH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        side, batch, tokens = args.worker[0], int(args.worker[1]), int(args.worker[2])
        quant = {"group_size": args.group_size, "w4_method": args.w4_method}
        print(json.dumps(measure(side, batch, tokens, args.repeats, args.functions, args.ops, args.model, quant)),
              flush=True)
        return 0
    print("| side | batch | " + " | ".join(f"{p}: min / median ms" for p in PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    details, op_details = [], []
    for side in args.sides.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            done = subprocess.run([sys.executable, __file__, "--worker", side, str(batch), str(args.tokens),
                                   "--repeats", str(args.repeats)] + (["--functions"] if args.functions else [])
                                  + (["--ops"] if args.ops else []) + (["--model", args.model] if args.model else [])
                                  + ["--w4-method", args.w4_method, "--group-size", str(args.group_size)],
                                  stdout=subprocess.PIPE, text=True, check=True)  # stderr: the worker's progress
            parts = json.loads(done.stdout.strip().splitlines()[-1])
            cells = [f"{min(parts[p]):.2f} / {statistics.median(parts[p]):.2f}" for p in PARTS]
            print(f"| {side} | {batch} | " + " | ".join(cells) + " |", flush=True)
            if args.functions:
                details.append((f"{side} batch {batch}", parts["functions"]))
            if args.ops:
                op_details.append((f"{side} batch {batch}", parts["ops"], statistics.mean(parts["forward"]) * 1e3))
    if details:
        print("\n| host function (inclusive) | " + " | ".join(f"{label}: us/step" for label, _ in details) + " |")
        print("|---|" + "---|" * len(details))
        for _, name in FUNCTIONS:
            print(f"| `{name}` | " + " | ".join(f"{us[name]:.1f}" for _, us in details) + " |")
    for label, per_op, forward_us in op_details:
        print(f"\n{label}: dlinfer ops of the graph, per decode step (forward mean {forward_us:.0f} us)")
        print("| op | calls | us | us a call |")
        print("|---|---|---|---|")
        for op, (us, calls) in sorted(per_op.items(), key=lambda kv: -kv[1][0]):
            print(f"| {op} | {calls:.1f} | {us:.1f} | {us / calls if calls else 0:.2f} |")
        rest = forward_us - sum(us for us, _ in per_op.values())
        print(f"| (the forward's rest: the graph's own Python, torch ops) | | {rest:.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
