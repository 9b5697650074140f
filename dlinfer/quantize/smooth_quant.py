"""SmoothQuant (Xiao et al.): per input channel scales s = max|x|^alpha / max|w|^(1-alpha)
folded into the preceding norm or linear, then int8 weights per output channel, stored the way
LMDeploy's `lite smooth_quant` stores them (q_modules.QLinear): `weight int8 [N, K]`,
`scale float32 [N, 1]`, with weight = clamp(round(w / scale), -128, 127), scale = max|w| / 127."""

from __future__ import annotations

ALPHA = 0.5


def int8_tensors(weight):
    """{weight int8 [N, K], scale float32 [N, 1]} of a float `weight [N, K]`."""
    import torch

    w = weight.float()
    scale = w.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row stays zero
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "scale": scale.to(torch.float32)}


def smooth_scales(x, weights, alpha: float = ALPHA):
    """s [K] float32 for activations `x [R, K]` feeding the concatenated `weights [N_i, K]`."""
    import torch

    act = x.float().abs().amax(0).clamp(min=1e-5)
    w = torch.cat([wi.float() for wi in weights], 0).abs().amax(0).clamp(min=1e-5)
    s = (act.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def moe_groups(layer) -> list:
    """The smoothing pairs of a Mixtral decoder layer, as awq.groups gives them for a dense one:
    norm -> q/k/v, v -> o (same widths only), the post-attention norm -> the router and every
    expert's w1/w3 (one scale for all: they read the same normed hidden states; the router stays
    float, so folding into it is exact), and each expert's w3 -> w2."""
    attn, moe = layer.self_attn, layer.block_sparse_moe
    out = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj")]
    if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
        out.append((attn.v_proj, [attn.o_proj], "self_attn.o_proj"))
    experts = list(moe.experts)
    out.append((layer.post_attention_layernorm, [moe.gate] + [e.w1 for e in experts] + [e.w3 for e in experts],
                "block_sparse_moe.gate"))
    out += [(e.w3, [e.w2], f"block_sparse_moe.experts.{i}.w2") for i, e in enumerate(experts)]
    return out


def smooth_layer(layer, inputs: dict, alpha: float = ALPHA) -> list:
    """Fold SmoothQuant scales into `layer` in place (the same pairs as AWQ: norm -> q/k/v,
    v -> o without grouped-query attention, norm -> gate/up, up -> down; for a Mixtral layer the
    pairs of `moe_groups`). A pair whose input was never seen (an expert no calibration token
    reached) is left unsmoothed. Returns, per pair, (linear names, max|x| over channels before,
    after)."""
    import torch

    from dlinfer.quantize.awq import fold_into_linear, fold_into_norm, groups

    report = []
    for prev, linears, name in (moe_groups(layer) if hasattr(layer, "block_sparse_moe") else groups(layer)):
        x = inputs.get(name)
        if x is None or x.shape[0] == 0:
            continue
        s = smooth_scales(x, [lin.weight for lin in linears], alpha)
        if isinstance(prev, torch.nn.Linear):
            fold_into_linear(prev, linears, s)
        else:
            fold_into_norm(prev, linears, s)
        names = [n for n, m in layer.named_modules() if any(m is lin for lin in linears)]
        before = x.float().abs().amax().item()
        report.append((names, before, (x.float() / s).abs().amax().item()))
    return report
