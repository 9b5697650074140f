"""The `dlinfer` torch.compile backend.

    torch.compile(model, backend="dlinfer")                     # entry point torch_dynamo_backends
    torch.compile(model, backend="dlinfer", options={"passes": "-rotary", "compiler": "eager"})

For each graph Dynamo captures it:
1. runs the rewrite passes (dlinfer/graph/passes) on Dynamo's FX graph, turning unfused RMSNorm,
   rotary and SiLU-and-mul patterns into `torch.ops.dlinfer.*` nodes and merging duplicated
   metadata derivations;
2. hands the result to a graph compiler: the active vendor's `graph_compiler` when it declares one,
   else Inductor, which keeps every dlinfer op opaque (an extern call to the vendor kernel) and
   compiles the glue between them. `direct` instead runs the graph as Python with every dlinfer
   op bound to its vendor kernel (no codegen, no dispatcher): what LMDeploy's graph mode uses on
   the CPU, where it is the faster of the two (docs/graph.md, docs/benchmarks.md).

Options (the `options=` dict of torch.compile; environment variables give the defaults):
    passes     DLINFER_GRAPH_PASSES     "all" | "none" | "a,b" | "-a,-b"   (see passes/__init__.py)
    compiler   DLINFER_GRAPH_COMPILER   "auto" | "inductor" | "direct" | "eager" | a callable(gm, inputs)
    inductor   -                        dict of Inductor config patches (with compiler inductor/auto)
    specialize -                        regex of symbolic sizes to compile per value (specialize.py)
`mode=` ("max-autotune", ...) is forwarded to Inductor.

Graphs that contain dlinfer ops are inference graphs (the ops have no autograd formula): they are
compiled and run with grad disabled. Graphs without any dlinfer op keep autograd.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.fx as fx

import dlinfer.ops  # noqa: F401  (registers torch.ops.dlinfer.*)
from dlinfer import envs
from dlinfer.graph import match, passes, specialize
from dlinfer.vendor import selection

log = logging.getLogger("dlinfer.graph")

# Running totals, for tests and diagnostics: graphs compiled, rewrites per pass, compiler used.
stats: collections.Counter = collections.Counter()

_OPTION_KEYS = {"passes", "compiler", "inductor", "specialize"}
BIND_ENV = "DLINFER_GRAPH_BIND"  # "0": the direct compiler leaves every node on its op function


def _device_type(example_inputs: Sequence[Any]) -> str:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device.type
    return "cpu"


def inductor_compiler(gm: fx.GraphModule, example_inputs, config_patches: Optional[Dict[str, Any]] = None):
    """The default graph compiler: Inductor, dlinfer ops left as extern kernel calls."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches or {})


def eager_compiler(gm: fx.GraphModule, example_inputs):
    """Run the rewritten graph as is (no codegen): dlinfer ops still go through torch.ops."""
    return gm.forward


def direct_compiler(gm: fx.GraphModule, example_inputs):
    """Run the rewritten graph as Python, each dlinfer op bound to its vendor kernel.

    No codegen and no dispatcher: a dlinfer node calls the function `dlinfer.vendor.resolve`
    gives for its op and device *now* (a later vendor switch does not reach this graph), with the
    canonical arguments the node already holds, or what the vendor's `graph_bindings` make of that
    function for the node's traced arguments (the kernel itself, chosen once: `_bound`). What
    remains per call is the graph's own Python (views, casts) around the kernels: no model code, no
    argument checks, no torch.ops dispatch.
    """
    switch = envs.get(BIND_ENV) or "1"
    if switch not in ("0", "1"):
        raise ValueError(f"{BIND_ENV}={switch!r}: expected '1' (the default) or '0'")
    for node in match.dlinfer_nodes(gm.graph):
        op = match.dlinfer_op_name(node)
        tensors = [match.tval(a) for a in node.all_input_nodes]
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        fn, vendor = selection.resolve(op, device.type)
        node.target = (_bound(node, op, fn, vendor) if switch == "1" else None) or fn
        if node.target is not fn:
            stats[f"bound:{op}"] += 1
    gm.recompile()
    return forward_with_own_stack_chunk(gm)


def _static(value) -> bool:
    """Whether a traced value is the same on every call of the graph: a constant, or a tensor
    whose sizes and strides are plain integers (no symbolic dimension)."""
    if isinstance(value, torch.Tensor):
        return all(isinstance(d, int) for d in (*value.shape, *value.stride()))
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _bound(node: fx.Node, op: str, fn: Callable, vendor) -> Optional[Callable]:
    """The vendor's call-site binding of `op` for this node (Vendor.graph_bindings), or None:
    when the vendor has none, when `fn` is not the vendor's own function (an op tool's wrapper
    sees every call), or when a tensor argument's sizes or strides are symbolic. Symbolic
    integer arguments (a dynamic max_kv_seq_len) stay arguments, passed as they are."""
    bind = vendor.graph_bindings.get(op)
    if bind is None or fn is not vendor.ops.get(op):
        return None
    missing = object()

    def example(a):
        if isinstance(a, fx.Node):
            v = match.val(a)
            return missing if v is None else v
        if isinstance(a, (list, tuple)):
            return type(a)(example(x) for x in a)
        return a

    positional = _positional(node)
    if positional is None:
        return None
    args = [example(a) for a in positional]
    tensors = [v for v in args if isinstance(v, torch.Tensor)]
    if any(v is missing for v in args) or not all(_static(t) for t in tensors):
        return None
    bound = bind(*args)
    if bound is not None:
        node.args, node.kwargs = tuple(positional), {}  # a bound kernel may take positional arguments only
    return bound


def _positional(node: fx.Node) -> Optional[list]:
    """Every argument of the op call `node` in its schema's order, keyword arguments and defaults
    filled in; None when the call does not fit the schema."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):  # what Dynamo records for torch.ops.dlinfer.<op>(...)
        target = getattr(target, "default", None)
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None if node.kwargs else list(node.args)
    names = [a.name for a in schema.arguments]
    if len(node.args) > len(names) or set(node.kwargs) - set(names[len(node.args):]):
        return None
    args = list(node.args)
    for a in schema.arguments[len(args):]:
        if a.name in node.kwargs:
            args.append(node.kwargs[a.name])
        elif a.has_default_value():
            args.append(a.default_value)
        else:
            return None
    return args


# CPython (3.11 to 3.13) keeps frames on a per-thread data stack of 16 KB chunks; a frame that does
# not fit in what is left of the current chunk gets a new one (mmap), freed (munmap) as soon as that
# frame returns. A generated graph forward is a large frame (a local per node: ~1300 for a 30-layer
# decoder, ~11 KB) calling hundreds of small Python functions (the vendor kernels' wrappers); when
# it happens to end just short of a chunk's end, every one of those calls maps and unmaps 16 KB.
# On SmolLM2 that made a W8A8 decode step 2.3x slower inside LMDeploy's pipeline, depending on the
# call depth the graph was entered at (one extra wrapper frame anywhere above moved it away;
# docs/graph.md, "The graph's frame"). A frame larger than a chunk always gets a chunk of its own with
# at least 1000 free words after it (CPython's MINIMUM_OVERHEAD), so the calls it makes never cross
# a chunk boundary: one map and unmap per graph call instead of one per kernel call.
_STACK_CHUNK_WORDS = 16 * 1024 // 8


def forward_with_own_stack_chunk(gm: fx.GraphModule) -> Callable:
    """`gm`'s generated forward, bound to it, its frame made larger than a data-stack chunk
    (more evaluation-stack slots, unused) so that it runs at the start of a chunk of its own.
    Called directly: no `nn.Module.__call__` around it (a graph module has no hooks)."""
    import types

    real_recompile = getattr(gm, "real_recompile", None)  # a _LazyGraphModule generates its code on first call
    if real_recompile is not None:
        real_recompile()
    fn = type(gm).forward
    code = fn.__code__
    words = code.co_nlocals + len(code.co_cellvars) + len(code.co_freevars) + code.co_stacksize
    if words <= _STACK_CHUNK_WORDS:
        code = code.replace(co_stacksize=code.co_stacksize + _STACK_CHUNK_WORDS + 1 - words)
    padded = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    padded.__kwdefaults__, padded.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return types.MethodType(padded, gm)


def _choose_compiler(choice, device_type: str, inductor_patches: Dict[str, Any]) -> Callable:
    if callable(choice):
        return choice
    if choice in (None, "", "auto"):
        vendor = selection.current(device_type)
        if vendor.graph_compiler is not None:
            stats[f"compiler:{vendor.name}"] += 1
            return vendor.graph_compiler
        choice = "inductor"
    stats[f"compiler:{choice}"] += 1
    if choice == "inductor":
        return functools.partial(inductor_compiler, config_patches=inductor_patches)
    if choice == "eager":
        return eager_compiler
    if choice == "direct":
        return direct_compiler
    raise ValueError(f"dlinfer graph: unknown compiler {choice!r}; "
                     "use 'auto', 'inductor', 'direct', 'eager' or a callable")


def _no_grad(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args):
        with torch.no_grad():
            return fn(*args)

    return run


def dlinfer_backend(gm: fx.GraphModule, example_inputs, *, mode: Optional[str] = None,
                    options: Optional[Dict[str, Any]] = None):
    """torch.compile backend: dlinfer rewrite passes, then the vendor's compiler or Inductor.

    With `options["specialize"]`, a regular expression (`re.fullmatch`) over Dynamo's source names of
    the graph's symbolic ints (such as `L['input_ids'].size()[1]`), and the direct compiler, a graph
    that has such symbols is compiled per value of them, on its first call with that value, each
    copy with those sizes constant (dlinfer/graph/specialize.py); the graph Dynamo traced is kept as
    it is for that. Other compilers compile the traced graph, symbolic sizes and all."""
    options = dict(options or {})
    unknown = set(options) - _OPTION_KEYS
    if unknown:
        raise ValueError(f"dlinfer graph: unknown option(s) {sorted(unknown)}; known: {sorted(_OPTION_KEYS)}")
    names = passes.select(options.get("passes", envs.get("DLINFER_GRAPH_PASSES")))
    patches = dict(options.get("inductor") or {})
    if mode and mode != "default":
        patches = {**torch._inductor.list_mode_options(mode), **patches}
    compiler = _choose_compiler(options.get("compiler", envs.get("DLINFER_GRAPH_COMPILER")),
                                _device_type(example_inputs), patches)
    pattern = options.get("specialize")
    # Only the direct compiler: it reads sizes from the graph's fake values and takes the first
    # call's inputs for nothing else. Inductor (or a vendor's compiler) handed a call's real inputs
    # would specialise every size on them, the free ones too: it compiles the traced graph instead.
    symbols = specialize.fixed_symbols(gm, pattern) if pattern and compiler is direct_compiler else []
    if symbols:
        stats["graphs:per_size"] += 1
        return specialize.PerSizeGraph(gm, symbols, functools.partial(_compile, names=names, compiler=compiler))
    return _compile(gm, example_inputs, names=names, compiler=compiler)


def _compile(gm: fx.GraphModule, example_inputs, *, names, compiler: Callable):
    """The passes `names` on gm (in place), then `compiler`; run without grad when the graph has
    dlinfer ops."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("dlinfer graph before passes %s:\n%s", names, gm.code)
    counts = passes.run(gm, names)
    stats["graphs"] += 1
    stats.update({k: v for k, v in counts.items() if v})
    if log.isEnabledFor(logging.DEBUG):
        log.debug("dlinfer graph after passes %s:\n%s", counts, gm.code)
    if not match.dlinfer_nodes(gm.graph) or not torch.is_grad_enabled():
        return compiler(gm, example_inputs)
    with torch.no_grad():
        compiled = compiler(gm, example_inputs)
    return _no_grad(compiled)
