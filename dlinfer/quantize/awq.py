"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization"): per input channel scales, one
exponent alpha searched on a grid per group of linears to minimise the error of the linears'
outputs on the calibration activations, folded into the preceding norm or linear; then
asymmetric 4-bit group quantisation (round to nearest, zero point). The scales are AutoAWQ's
"duo" form s = mean|x|^alpha / mean|w~|^(1 - alpha), w~ = |w| / max|w| of its group (the
weight's own spread, mean over the output rows); `duo=False` is the paper's s = mean|x|^alpha.
s = 1 (round-to-nearest, RTN) is always the grid's first point, so the search never does worse
than RTN on its own objective."""

from __future__ import annotations

N_GRID = 20
MAX_ROWS = 4096  # calibration rows (tokens) used in the search loss (seeded subsample)
BITS = 4
QMAX = 2**BITS - 1


def quant_params(w, group_size: int, scale_dtype):
    """Asymmetric 4-bit parameters of `w [N, K]` per group of `group_size` along K:
    (q uint8-valued int32 [N, K], zero int32 [N, K/g], scale float32 [N, K/g]) with the scale
    rounded to `scale_dtype` (what the checkpoint stores) before q is computed, so that
    (q - zero) * scale is exactly what a loader dequantises."""
    import torch

    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    q, zero, scale = round_groups(g, g.amin(-1), g.amax(-1), scale_dtype)
    return q.reshape(n, k).to(torch.int32), zero.to(torch.int32), scale


def round_groups(g, lo, hi, scale_dtype):
    """The rounding of `quant_params` for groups `g [..., G, g]` (float32) between `lo` and `hi`
    ([..., G]: the groups' min and max, or a clipped range): (q, zero, scale) float32, q [..., G, g]
    and zero in 0..QMAX, scale = (hi - lo) / QMAX rounded to `scale_dtype`."""
    import torch

    scale = ((hi - lo).clamp(min=1e-5) / QMAX).to(scale_dtype).float()
    zero = torch.round(-lo / scale).clamp(0, QMAX)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, QMAX)
    return q, zero, scale


def fake_quant(w, group_size: int, scale_dtype):
    """`w [N, K]` quantised and dequantised (float32)."""
    q, zero, scale = quant_params(w, group_size, scale_dtype)
    n, k = w.shape
    deq = (q.reshape(n, -1, group_size) - zero[..., None]).float() * scale[..., None]
    return deq.reshape(n, k)


def weight_mean(weights, group_size: int):
    """`[K]`: mean over the output rows of |w| / max|w| of its group, for the `weights [N_i, K]`."""
    import torch

    w = torch.cat([wi.detach().float() for wi in weights], 0)
    n, k = w.shape
    g = w.abs().reshape(n, k // group_size, group_size)
    return (g / (g.amax(-1, keepdim=True) + 1e-6)).reshape(n, k).mean(0)


def candidate(x_mean, w_mean, alpha: float):
    """The scales `[K]` for one alpha: mean|x|^alpha (/ w_mean^(1 - alpha) when w_mean is given),
    normalised by sqrt(max s * min s)."""
    s = x_mean.pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def grid_errors(x, weights, group_size: int, scale_dtype, n_grid: int = N_GRID, duo: bool = True) -> list:
    """[(alpha, s [K] float32, relative error)] over the grid, RTN first: the error is
    ||x W^T - x (Q(W s) / s)^T||^2 / ||x W^T||^2 for `x [R, K]` and the concatenated
    `weights [N_i, K]`; alpha -1 stands for s = 1 (RTN), then alpha = 0, 1/n_grid, ..., (n_grid-1)/n_grid
    (n_grid = 0: RTN alone)."""
    import torch

    if x.shape[0] > MAX_ROWS:
        gen = torch.Generator().manual_seed(0)
        x = x[torch.randperm(x.shape[0], generator=gen)[:MAX_ROWS]]
    x = x.float()
    w = torch.cat([wi.detach().float() for wi in weights], 0)
    ref = x @ w.T
    norm = ref.pow(2).mean().clamp(min=1e-30)
    x_mean = x.abs().mean(0)
    w_mean = weight_mean(weights, group_size) if duo and n_grid else None
    points = []
    # RTN (s = 1, reported as alpha -1) first: with duo, alpha = 0 is s = 1 / w_mean, not RTN
    for alpha, wm in [(-1.0, None)] + [(i / n_grid, w_mean) for i in range(n_grid)]:
        s = candidate(x_mean, wm, max(alpha, 0.0))
        wq = fake_quant(w * s, group_size, scale_dtype) / s
        points.append((alpha, s, ((x @ wq.T - ref).pow(2).mean() / norm).item()))
    return points


def best_point(points: list):
    """The (alpha, s, error) of `grid_errors` with the lowest error (the first of equals)."""
    return min(points, key=lambda p: p[2])


def search_scales(x, weights, group_size: int, scale_dtype, n_grid: int = N_GRID, duo: bool = True):
    """(alpha, s [K] float32, relative error): the grid point of `grid_errors` minimising the error."""
    return best_point(grid_errors(x, weights, group_size, scale_dtype, n_grid, duo))


def fold_into_norm(norm, linears, s) -> None:
    """norm.weight /= s; each linear's weight columns *= s (the product is unchanged)."""
    import torch

    with torch.no_grad():
        norm.weight.div_(s.to(norm.weight.dtype))
        for lin in linears:
            lin.weight.mul_(s.to(lin.weight.dtype).view(1, -1))


def fold_into_linear(prev, linears, s) -> None:
    """prev's output rows (and bias) /= s; each linear's weight columns *= s."""
    import torch

    with torch.no_grad():
        prev.weight.div_(s.to(prev.weight.dtype).view(-1, 1))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
        for lin in linears:
            lin.weight.mul_(s.to(lin.weight.dtype).view(1, -1))


def groups(layer):
    """(prev module, [linears], name of the linear whose input is recorded) for one decoder layer:
    the norms before q/k/v and gate/up, v before o (only when their widths match: not under
    grouped-query attention), up before down."""
    attn, mlp = layer.self_attn, layer.mlp
    out = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj")]
    if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
        out.append((attn.v_proj, [attn.o_proj], "self_attn.o_proj"))
    out.append((layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj"))
    out.append((mlp.up_proj, [mlp.down_proj], "mlp.down_proj"))
    return out


def scale_layer(layer, inputs: dict, group_size: int, scale_dtype, duo: bool = True) -> list:
    """Search and fold AWQ scales into `layer` in place; `inputs` maps a linear's name to its
    recorded input `[R, K]`. Returns one (linear names, alpha, rtn error, awq error) per group."""
    import torch

    report = []
    for prev, linears, name in groups(layer):
        x = inputs[name]
        points = grid_errors(x, [lin.weight for lin in linears], group_size, scale_dtype, duo=duo)
        rtn = points[0][2]  # the RTN point, for the progress line
        alpha, s, err = best_point(points)
        if isinstance(prev, torch.nn.Linear):
            fold_into_linear(prev, linears, s)
        else:
            fold_into_norm(prev, linears, s)
        names = [n for n, m in layer.named_modules() if any(m is lin for lin in linears)]
        report.append((names, alpha, rtn, err))
    return report
