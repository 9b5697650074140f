"""Run a HF decoder layer by layer on the calibration samples, recording what each step needs.

Layer i's input is layer i-1's output computed *after* layer i-1 was modified (smoothed or
AWQ-scaled), as in the AWQ paper's sequential calibration; every layer sees all samples at once
(`[S, T, H]`, the samples are short)."""

from __future__ import annotations

# The linears of a Llama / Qwen2 decoder layer, by attribute path.
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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
    {name: output [S, T, N]} likewise under the key name + ':out')."""
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
