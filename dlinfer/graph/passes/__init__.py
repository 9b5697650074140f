"""The rewrite passes, in the order the backend runs them.

Each pass takes Dynamo's FX GraphModule, rewrites it in place and returns how many patterns it
replaced. `select()` turns a switch (env var DLINFER_GRAPH_PASSES or the backend's `passes`
option) into the list of passes to run:

    "all" (default)          every pass
    "none" / "0" / ""        no pass
    "rms_norm,rotary"        only these
    "-rotary"                every pass but these (entries starting with "-")
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Union

import torch.fx as fx

from dlinfer.graph.passes.cse import cse_pass
from dlinfer.graph.passes.rms_norm import add_rms_norm_pass, rms_norm_pass
from dlinfer.graph.passes.rotary import rotary_pass
from dlinfer.graph.passes.silu_and_mul import silu_and_mul_pass
from dlinfer.graph.passes.split_heads import split_heads_pass
from dlinfer.graph.passes.view_chains import view_chain_pass

# cse first (fewer nodes to match); add_rms_norm after rms_norm: it fuses adds into the rms_norm
# nodes the latter wrote; split_heads after rotary (whose pattern starts at the unflattened heads);
# view_chains last (the fusions' patterns are matched through the views
# as the model wrote them).
PASSES: Dict[str, Callable[[fx.GraphModule], int]] = {
    "cse": cse_pass,
    "rotary": rotary_pass,
    "silu_and_mul": silu_and_mul_pass,
    "rms_norm": rms_norm_pass,
    "add_rms_norm": add_rms_norm_pass,
    "split_heads": split_heads_pass,
    "view_chains": view_chain_pass,
}


def select(spec: Union[str, Sequence[str], None]) -> List[str]:
    """Names of the passes to run, in PASSES order, for a switch value (see module docstring)."""
    if spec is None:
        return list(PASSES)
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",")]
    names = [s for s in spec if s]
    if not names or names == ["none"] or names == ["0"]:
        return []
    if names == ["all"] or names == ["1"]:
        return list(PASSES)
    removed = {n[1:] for n in names if n.startswith("-")}
    kept = {n for n in names if not n.startswith("-")}
    unknown = sorted((removed | kept) - set(PASSES))
    if unknown:
        raise ValueError(f"dlinfer graph: unknown pass(es) {unknown}; known: {list(PASSES)}")
    if kept and removed:
        raise ValueError("dlinfer graph: list passes to run or passes to skip ('-name'), not both")
    chosen = kept if kept else set(PASSES) - removed
    return [n for n in PASSES if n in chosen]


def run(gm: fx.GraphModule, names: Sequence[str]) -> Dict[str, int]:
    """Run the named passes on gm (in PASSES order); returns {pass: rewrites}."""
    counts = {}
    for name in PASSES:
        if name in names:
            counts[name] = PASSES[name](gm)
    if any(counts.values()):
        gm.graph.lint()
        gm.recompile()
    return counts
