"""Run a HF decoder layer by layer on the calibration samples, recording what each step needs.

Layer i's input is layer i-1's output computed *after* layer i-1 was modified (smoothed or
AWQ-scaled), as in the AWQ paper's sequential calibration; every layer sees all samples at once
(`[S, T, H]`, the samples are short)."""

from __future__ import annotations

# The linears of a Llama / Qwen2 decoder layer, by attribute path.
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS = ATTENTION + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# A Mixtral layer's sparse MoE block: the router (kept in float: LMDeploy builds it unquantised)
# and each expert's gate (w1), up (w3) and down (w2) projections.
MOE_BLOCK = "block_sparse_moe"
ROUTER = MOE_BLOCK + ".gate"
EXPERT_LINEARS = ("w1", "w3", "w2")


def linears(layer) -> tuple:
    """The attribute paths of the linears quantised in `layer`: LINEARS for a dense layer; for a
    Mixtral layer the attention's and every expert's (`block_sparse_moe.experts.{e}.w1/w3/w2`)."""
    moe = getattr(layer, MOE_BLOCK, None)
    if moe is None:
        return LINEARS
    return ATTENTION + tuple(f"{MOE_BLOCK}.experts.{e}.{w}" for e in range(len(moe.experts)) for w in EXPERT_LINEARS)


def recorded(layer) -> tuple:
    """The modules whose inputs a calibration pass of `layer` records: its quantised linears, and
    a MoE layer's router (its input is what the smoothing of the experts' w1/w3 reads)."""
    return linears(layer) + ((ROUTER,) if hasattr(layer, MOE_BLOCK) else ())


class _Stop(Exception):
    pass


def first_layer_inputs(model, ids):
    """(hidden [S, T, H] float32, kwargs): what the model passes to its first decoder layer for
    token ids `ids [S, T]` (kwargs holds position_embeddings, the causal mask, ...)."""
    import torch

    captured = {}

    def grab(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    layer0 = model.model.layers[0]
    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    kwargs = captured["kwargs"]
    kwargs["use_cache"] = False
    kwargs["past_key_values"] = None
    return captured["hidden"], kwargs


def run_layer(layer, hidden, kwargs, record=()):
    """(output [S, T, H], {name: input [S*T, K]} for the linears named in `record`,
    {name: output [S, T, N]} likewise under the key name + ':out'). A module the layer never calls
    (an expert no calibration token was routed to) has no entry."""
    import torch

    seen, handles = {}, []
    for name in record:
        module = layer.get_submodule(name)

        def hook(mod, args, out, name=name):
            seen[name] = args[0].detach().reshape(-1, args[0].shape[-1])
            seen[name + ":out"] = out.detach()

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = layer(hidden, **kwargs)
    finally:
        for h in handles:
            h.remove()
    out = out[0] if isinstance(out, tuple) else out
    return out, seen
