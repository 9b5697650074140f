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


def smooth_layer(layer, inputs: dict, alpha: float = ALPHA) -> list:
    """Fold SmoothQuant scales into `layer` in place (the same pairs as AWQ: norm -> q/k/v,
    v -> o without grouped-query attention, norm -> gate/up, up -> down). Returns, per pair,
    (linear names, max|x| over channels before, after)."""
    import torch

    from dlinfer.quantize.awq import fold_into_linear, fold_into_norm, groups

    report = []
    for prev, linears, name in groups(layer):
        x = inputs[name]
        s = smooth_scales(x, [lin.weight for lin in linears], alpha)
        if isinstance(prev, torch.nn.Linear):
            fold_into_linear(prev, linears, s)
        else:
            fold_into_norm(prev, linears, s)
        names = [n for n, m in layer.named_modules() if any(m is lin for lin in linears)]
        before = x.float().abs().amax().item()
        report.append((names, before, (x.float() / s).abs().amax().item()))
    return report
