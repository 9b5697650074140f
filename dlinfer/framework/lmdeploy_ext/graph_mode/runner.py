"""LMDeploy graph mode on dlinfer device types: decode steps compiled with the dlinfer backend.

`PytorchEngineConfig(device_type="cpu", eager_mode=False)` makes the ops backend build this
runner (`build_graph_runner`). Written against LMDeploy 0.18.0, whose `GraphRunner`
(backends/graph_runner.py) is the interface: the model agent calls `runner(**model_inputs)` for
every forward and warms up one decode step per `get_capture_batch_sizes()` entry.

What it does
- Prefill, multi-token decode, embeddings input and anything unusual run eagerly (the model itself).
- A one-token-per-sequence decode step of B sequences is padded to the smallest bucket >= B
  (1, 2, 4, ... max_batches, or `cudagraph_capture_batch_sizes`) and run through
  `torch.compile(model, backend=dlinfer_backend, dynamic=False, fullgraph=True)`; the real rows of
  the hidden states come back. One trace in all, at warm-up, with a dynamic batch that every
  bucket shares, compiled per bucket ("One trace for every bucket" below; DLINFER_GRAPH_BATCH=static
  traces one graph per bucket instead). The graph compiler is "direct" (vendor kernels called from
  the captured graph, docs/graph.md) unless DLINFER_GRAPH_COMPILER names another or the vendor
  declares its own.
- A model Dynamo cannot capture whole logs a warning and runs eagerly.
- Vision-language models: a decode step passes their image inputs as None (it runs a graph like a
  text model's) and Qwen2-VL's mrope positions [3, B], padded to the bucket like `position_ids`;
  prefill steps, which run the vision tower, are eager as for every model. The remote-code
  InternVL (`InternVLChatModel`) also passes LMDeploy's `StepContext` as `context`, which its
  forward reads only in its token-compressing `flash_mode`: without that mode a decode step drops
  it and runs a graph (`_UNUSED_CONTEXT`).

Keeping recompiles bounded (one, whatever the batch sizes and lengths): the graph is static
(`dynamic=False`) except for the two things that grow with the sequences, and the batch size,
marked dynamic through `torch.compiler.config.dynamic_sources`:
- `max_kv_seq_len`, the only integer the decode graph reads that changes every step (a SymInt
  in the graph, passed to the custom op); without this Dynamo specialises on it and recompiles
  at every step;
- the block table's width (blocks of the longest sequence), kept >= 2 because Dynamo
  specialises dimensions of size 1 whatever it is told (unless size-oblivious, below);
- the batch dims of the step's tensors (`BATCH_SOURCES`; not with DLINFER_GRAPH_BATCH=static).
Everything else the graph reads per step is a tensor of fixed shape for the bucket
(`kv_flatten_size`, which also changes, is never read by the graph).

One trace for every bucket: Dynamo's tracing of the model's Python is what a compile costs
(nearly 90% of it for SmolLM2; the dlinfer backend's passes and compiler 0.1-0.2 s). With the
batch dims marked dynamic and Dynamo's sizes size-oblivious while it traces (`_size_semantics`:
without it Dynamo specialises a size of 1, and bucket 1, the one-request decode, would need a
trace of its own), one trace serves every bucket. The backend compiles the shared graph once per
bucket, on the bucket's first call, with the batch sizes fixed (its `specialize` option,
`BATCH_SIZES`; dlinfer/graph/specialize.py): the same code, view passes and bound call sites as a
graph traced for that bucket, for ~0.2 s a bucket instead of a trace. Each bucket replays the
graph it ran. A pipeline of SmolLM2 at `max_batch_size=64` starts in 0.43x the time it takes
with a trace per bucket, and its steps run the same code (docs/graph.md, "LMDeploy graph mode").
DLINFER_GRAPH_BATCH=static keeps one trace per bucket. With a compiler other than "direct" the
shared graph runs with symbolic sizes.

Guards after warm-up: once every bucket has its graph (LMDeploy warms one decode step per bucket
at start-up), a step evaluates only the guards that tell those graphs apart
(`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`): the full set, about a millisecond a
step for a 30-layer model on 2 cores (most of them on the model's parameters), can only fail on
what differs between buckets, since everything else a decode step hands the graph is fixed for the
engine's life (the padding above makes even the tensors' provenance uniform).
DLINFER_GRAPH_GUARDS=full evaluates every guard at every step.

Replay: once a bucket's graph is compiled, its later steps do not go back through Dynamo at all:
graph_mode/replay.py gathers the graph's inputs from the step's arguments by Dynamo's own source
expressions and calls the graph (the cache lookup, guards and input gathering cost ~0.5 ms a
step on 2 cores). Same contract as the warm guards above, and as LMDeploy's CUDA graphs: the
bucket picks the graph, the forward's Python runs only when the graph is made. A graph whose
inputs or output cannot be found that way keeps the Dynamo path; DLINFER_GRAPH_GUARDS=full
or DLINFER_GRAPH_REPLAY=0 turn replay off.

Padding rows: one token each (cu_seqlens step 1), kv length 1 over the first real sequence's
first block (finite data, never NaN), KV slot -1, which every vendor's fill_kv_cache drops
(docs/design.md, "Checks": kernels mask bad slots). Their outputs are discarded; every op is row-independent.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
from typing import Any, Dict, Optional

import torch
from lmdeploy.pytorch.backends.dlinfer.attention import DlinferAttentionMetadata
from lmdeploy.pytorch.backends.graph_runner import GraphRunner

from dlinfer import envs
from dlinfer.framework.lmdeploy_ext.graph_mode.replay import CompiledGraph, GraphReplay
from dlinfer.graph.specialize import size_pattern
from dlinfer.vendor import selection

log = logging.getLogger("dlinfer.lmdeploy.graph")

# Dynamo source names of what changes per step but must not recompile (see the module docstring).
DYNAMIC_SOURCES = r"L\['attn_metadata'\]\.max_kv_seq_len,L\['attn_metadata'\]\.block_offsets:1"
# The batch dims of a decode step's tensors ([1, B] token rows, [B] / [B + 1] / [B, W] metadata,
# Qwen2-VL's [3, B] positions): dynamic unless DLINFER_GRAPH_BATCH=static (the module docstring).
BATCH_SOURCES = ",".join(
    [r"L\['input_ids'\]:1", r"L\['position_ids'\]:1", r"L\['mrope_position_ids'\]:1"]
    + [rf"L\['attn_metadata'\]\.{name}:0" for name in (
        "block_offsets", "kv_seqlens", "kv_seqlens_cpu", "kv_start_indices", "q_seqlens", "q_start_loc",
        "cu_seqlens_q", "cu_seqlens_q_cpu")])
# The same dims as Dynamo names the graph's symbolic ints (`L['input_ids'].size()[1]`): the sizes the
# shared graph is compiled per value of (the backend's "specialize" option).
BATCH_SIZES = size_pattern(BATCH_SOURCES)
_FORWARD_KEYS = {"input_ids", "position_ids", "past_key_values", "attn_metadata", "inputs_embeds"}
# Per-token inputs of vision-language models' decode steps, padded like `position_ids` (along their
# last dim): Qwen2-VL's multimodal rope positions [3, T]. Their other inputs (pixel values, image
# masks, ...) are None in a decode step; a step that carries any of them runs eagerly.
_PER_TOKEN_KEYS = {"mrope_position_ids"}
# Models whose forward takes `context` (LMDeploy's StepContext) but reads it in a plain decode step
# only in a mode named here (the model attribute that turns the mode on): without it, dropped.
_UNUSED_CONTEXT = {"InternVLChatModel": "flash_mode"}
REPLAY_ENV = "DLINFER_GRAPH_REPLAY"  # "0": warm steps go through Dynamo (see "Replay" in the docstring)
GUARDS_ENV = "DLINFER_GRAPH_GUARDS"  # "full": every guard at every step; unset / "warm": see the docstring
BATCH_ENV = "DLINFER_GRAPH_BATCH"  # unset / "dynamic": see the docstring; "static": one trace per bucket


class DlinferGraphRunner(GraphRunner):
    """Decode steps through torch.compile(backend=dlinfer), padded to batch buckets."""

    def __init__(self, model: torch.nn.Module, model_config, cache_config, backend_config, device: torch.device,
                 compile_options: Optional[Dict[str, Any]] = None):
        super().__init__(model, model_config, cache_config, backend_config, device)
        self.enable_graph = not backend_config.eager_mode
        self.buckets = sorted(self.get_capture_batch_sizes())
        self.compiles = 0  # graphs the dlinfer backend compiled for this runner
        self.warm_buckets: set = set()  # buckets that have run a compiled graph through Dynamo
        self.graph_steps = 0  # decode steps that ran a compiled graph
        self._options = dict(compile_options or {})
        self._options.setdefault("compiler", _default_compiler(device))
        self._compiled = None
        self._replays: Dict[int, GraphReplay] = {}  # bucket -> its graph called without Dynamo
        self._ran_graph: Optional[CompiledGraph] = None  # the graph the current call ran, if any
        self._failed: Optional[BaseException] = None
        self._constants: Dict[int, Dict[str, torch.Tensor]] = {}
        mode = _UNUSED_CONTEXT.get(type(model).__name__)
        self._drops_context = mode is not None and getattr(model, mode, None) is None
        raw_guards = envs.get(GUARDS_ENV) or "warm"
        guards = raw_guards.lower()
        if guards not in ("warm", "full"):
            raise ValueError(f"{GUARDS_ENV}={raw_guards!r}: expected 'warm' (the default) or 'full'")
        self._all_guards = guards == "full"
        replay = envs.get(REPLAY_ENV) or "1"
        if replay not in ("0", "1"):
            raise ValueError(f"{REPLAY_ENV}={replay!r}: expected '1' (the default) or '0'")
        self._replay = replay == "1"
        raw_batch = envs.get(BATCH_ENV) or "dynamic"
        self.batch_mode = raw_batch.lower()
        if self.batch_mode not in ("dynamic", "static"):
            raise ValueError(f"{BATCH_ENV}={raw_batch!r}: expected 'dynamic' (the default) or 'static'")
        ours = DYNAMIC_SOURCES
        if self.batch_mode == "dynamic":
            ours += "," + BATCH_SOURCES
            self._options.setdefault("specialize", BATCH_SIZES)
        user_sources = torch.compiler.config.dynamic_sources
        self._dynamic_sources = f"{user_sources},{ours}" if user_sources else ours
        # Dynamo's recompile_limit (default 8) counts cache entries per code object: the model's
        # forward gets one per bucket, per engine in the process. Raised as LMDeploy's CUDA graph
        # runner does (never lowered); past it Dynamo would refuse to compile (fullgraph=True).
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 1024)

    # -- compilation -------------------------------------------------------------------------

    def _backend(self, gm, example_inputs):
        from dlinfer.graph.backend import dlinfer_backend

        self.compiles += 1
        return CompiledGraph(gm, dlinfer_backend(gm, example_inputs, options=self._options), on_call=self._graph_ran)

    def _size_semantics(self):
        """How Dynamo treats sizes while it traces: with the batch dims dynamic, size-oblivious
        (`backed_size_oblivious`: a batch of 1 gets a symbol like any other, not a specialised
        graph), so that bucket 1 shares the larger buckets' trace ("One trace for every bucket" in the
        module docstring)."""
        if self.batch_mode != "dynamic":
            return contextlib.nullcontext()
        return torch.fx.experimental._config.patch(backed_size_oblivious=True)

    def _graph_ran(self, graph: CompiledGraph) -> None:
        self._ran_graph = graph

    def _compiled_model(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.model, backend=self._backend, dynamic=False, fullgraph=True)
        return self._compiled

    # -- which steps run a graph ---------------------------------------------------------------

    def bucket_for(self, batch: int) -> Optional[int]:
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    def _graph_batch(self, kwargs: Dict[str, Any]) -> Optional[int]:
        """Batch size B when this forward is a plain one-token decode step, else None."""
        given = {key for key, value in kwargs.items() if value is not None}
        if not self.enable_graph or self._failed is not None or given - _FORWARD_KEYS - _PER_TOKEN_KEYS:
            return None
        meta = kwargs.get("attn_metadata")
        if not isinstance(meta, DlinferAttentionMetadata) or not meta.is_decoding or meta.max_q_seqlen != 1:
            return None
        if kwargs.get("inputs_embeds") is not None:
            return None
        batch = meta.q_seqlens.numel()
        if kwargs["input_ids"].numel() != batch or self.bucket_for(batch) is None:
            return None
        return batch

    # -- padding to the bucket -------------------------------------------------------------------

    def _constants_for(self, bucket: int, meta: DlinferAttentionMetadata) -> Dict[str, torch.Tensor]:
        """Metadata that is the same at every step of a bucket (one token per row)."""
        consts = self._constants.get(bucket)
        if consts is None:
            device = meta.q_seqlens.device
            steps = torch.arange(bucket + 1, dtype=torch.int32, device=device)
            consts = dict(cu_seqlens_q=steps, cu_seqlens_q_cpu=steps.cpu(),
                          q_seqlens=torch.ones(bucket, dtype=meta.q_seqlens.dtype, device=device))
            self._constants[bucket] = consts
        return consts

    def _bucket_metadata(self, bucket: int, meta: DlinferAttentionMetadata, **fields) -> DlinferAttentionMetadata:
        """`meta` with the bucket's constant query metadata (and `fields`) in place of its own."""
        consts = self._constants_for(bucket, meta)
        return dataclasses.replace(meta, q_start_loc=consts["cu_seqlens_q"][:-1], q_seqlens=consts["q_seqlens"],
                                   cu_seqlens_q=consts["cu_seqlens_q"], cu_seqlens_q_cpu=consts["cu_seqlens_q_cpu"],
                                   **fields)

    def _pad(self, kwargs: Dict[str, Any], batch: int, bucket: int) -> Dict[str, Any]:
        meta: DlinferAttentionMetadata = kwargs["attn_metadata"]
        pad = bucket - batch
        blocks = meta.block_offsets
        # At least 2 columns: Dynamo specialises a dimension of size 1 (dynamic_sources or not) unless
        # it traces size-oblivious, which it does only with the batch dynamic (`_size_semantics`).
        table = blocks.new_zeros(bucket, max(blocks.shape[1], 2))
        table[:batch, : blocks.shape[1]] = blocks
        table[batch:, 0] = blocks[0, 0]

        def padded(t: torch.Tensor, value) -> torch.Tensor:
            # Always a new tensor, even with nothing to pad: every step then hands Dynamo tensors
            # made the same way (an inference tensor or not is part of its guards).
            return torch.cat([t, t.new_full((pad, *t.shape[1:]), value)])

        kv_seqlens = padded(meta.kv_seqlens, 1)
        new_meta = self._bucket_metadata(
            bucket,
            meta,
            block_offsets=table,
            kv_seqlens=kv_seqlens,
            kv_seqlens_cpu=kv_seqlens if kv_seqlens.device.type == "cpu" else padded(meta.kv_seqlens_cpu, 1),
            kv_start_indices=padded(meta.kv_start_indices.view(-1), -1),
            kv_flatten_size=meta.kv_flatten_size + pad,
        )
        out = dict(kwargs)
        out["input_ids"] = padded(kwargs["input_ids"].view(-1), 0).view(1, bucket)
        out["position_ids"] = padded(kwargs["position_ids"].view(-1), 0).view(1, bucket)
        for key in _PER_TOKEN_KEYS:
            if kwargs.get(key) is not None:
                per_token = kwargs[key]
                out[key] = torch.cat([per_token, per_token.new_zeros((*per_token.shape[:-1], pad))], dim=-1)
        out["attn_metadata"] = new_meta
        return out

    def _replay_inputs(self, kwargs: Dict[str, Any], batch: int, bucket: int) -> Dict[str, Any]:
        """What a replayed graph reads: `_pad`'s inputs, or, when the batch fills its bucket (token
        ids and positions [1, bucket]) and the block table has the 2 columns `_pad` guarantees, the
        step's own tensors with the bucket's constant metadata (the same values, in the dtypes the
        graph was traced with). A replay evaluates no guards, so the fresh tensors `_pad` makes
        for Dynamo are not needed: this saves its copies (docs/benchmarks.md)."""
        meta: DlinferAttentionMetadata = kwargs["attn_metadata"]
        shaped = kwargs["input_ids"].shape == kwargs["position_ids"].shape == (1, bucket)
        if batch != bucket or not shaped or meta.block_offsets.shape[1] < 2:
            return self._pad(kwargs, batch, bucket)
        out = dict(kwargs)
        out["attn_metadata"] = self._bucket_metadata(bucket, meta)
        return out

    # -- the forward -----------------------------------------------------------------------------

    def __call__(self, **kwargs):
        if self._drops_context and kwargs.get("context") is not None:
            graph_kwargs = {key: value for key, value in kwargs.items() if key != "context"}
        else:
            graph_kwargs = kwargs
        batch = self._graph_batch(graph_kwargs)
        if batch is None:
            return self.model(**kwargs)
        kwargs = graph_kwargs
        bucket = self.bucket_for(batch)
        replay = self._replays.get(bucket)
        if replay is not None:
            self.graph_steps += 1
            return _real_rows(replay(self._replay_inputs(kwargs, batch, bucket), self.model), batch)
        padded = self._pad(kwargs, batch, bucket)
        warm = not self._all_guards and len(self.warm_buckets) >= len(self.buckets)
        self._ran_graph = None
        stance = (torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if warm
                  else contextlib.nullcontext())
        try:
            with stance, self._size_semantics(), torch.compiler.config.patch(dynamic_sources=self._dynamic_sources):
                output = self._compiled_model()(**padded)
        except Exception as exc:  # noqa: BLE001
            # A model Dynamo cannot capture whole runs eagerly from then on. An error raised by a
            # kernel once graphs have run is the step's own error: raised, as in eager mode. (The
            # eager rerun rewrites the same cache slots with the same values.)
            dynamo_errors = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)
            if self.graph_steps and not isinstance(exc, dynamo_errors):
                raise
            self._failed = exc
            log.warning("dlinfer graph mode: decode step could not be compiled (%s: %s); running eagerly",
                        type(exc).__name__, exc)
            return self.model(**kwargs)
        self.graph_steps += 1
        graph, self._ran_graph = self._ran_graph, None
        if graph is not None:
            if bucket not in self.warm_buckets:  # once: a graph that cannot be replayed is not examined every step
                self._keep_replay(bucket, graph, output)
            graph.last_outputs = None  # (GraphReplay.build has looked at them, or nobody will)
        self.warm_buckets.add(bucket)
        return _real_rows(output, batch)

    def _keep_replay(self, bucket: int, graph: CompiledGraph, output) -> None:
        """After `bucket`'s first call through Dynamo, which ran `graph` (compiled by that call, or
        shared with the other buckets): later steps of the bucket replay it (graph_mode/replay.py),
        unless replay is off (DLINFER_GRAPH_REPLAY=0, DLINFER_GRAPH_GUARDS=full)."""
        if self._all_guards or not self._replay:
            return
        replay = GraphReplay.build(graph, output)
        if replay is not None:
            self._replays[bucket] = replay

    def reset(self):
        super().reset()
        self._constants.clear()


def _default_compiler(device) -> str:
    """DLINFER_GRAPH_COMPILER if set; else the vendor's own compiler if it declares one; else
    "direct" (vendor kernels called straight from the captured graph, see docs/graph.md: on the
    CPU it beats Inductor here, whose opaque custom-op calls cost more than the glue it fuses)."""
    env = envs.get("DLINFER_GRAPH_COMPILER")
    if env:
        return env
    vendor = selection.current(torch.device(device).type)
    return "auto" if vendor.graph_compiler is not None else "direct"


def _real_rows(output, batch: int):
    if isinstance(output, torch.Tensor):
        return output[:, :batch]
    if isinstance(output, dict):
        return {k: v[:, :batch] if isinstance(v, torch.Tensor) and v.dim() > 1 else v for k, v in output.items()}
    raise TypeError(f"dlinfer graph mode: unexpected model output {type(output).__name__}")
