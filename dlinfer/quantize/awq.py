"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization"): per input channel scales
s = mean|x|^alpha, alpha searched on a grid to minimise the error of the linears' outputs on the
calibration activations, folded into the preceding norm or linear; then asymmetric 4-bit group
quantisation (round to nearest, zero point). alpha = 0 is on the grid, so the search never does
worse than round-to-nearest (RTN) on its own objective."""

from __future__ import annotations

N_GRID = 20
MAX_ROWS = 4096  # calibration rows used in the search loss (seeded subsample)
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
    hi, lo = g.amax(-1), g.amin(-1)
    scale = ((hi - lo).clamp(min=1e-5) / QMAX).to(scale_dtype).float()
    zero = torch.round(-lo / scale).clamp(0, QMAX)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, QMAX)
    return q.reshape(n, k).to(torch.int32), zero.to(torch.int32), scale


def fake_quant(w, group_size: int, scale_dtype):
    """`w [N, K]` quantised and dequantised (float32)."""
    q, zero, scale = quant_params(w, group_size, scale_dtype)
    n, k = w.shape
    deq = (q.reshape(n, -1, group_size) - zero[..., None]).float() * scale[..., None]
    return deq.reshape(n, k)


def search_scales(x, weights, group_size: int, scale_dtype, n_grid: int = N_GRID):
    """(alpha, s [K] float32, relative error): the grid point minimising
    ||x W^T - x (Q(W s) / s)^T||^2 for `x [R, K]` and the concatenated `weights [N_i, K]`."""
    import torch

    if x.shape[0] > MAX_ROWS:
        gen = torch.Generator().manual_seed(0)
        x = x[torch.randperm(x.shape[0], generator=gen)[:MAX_ROWS]]
    x = x.float()
    w = torch.cat([wi.float() for wi in weights], 0)
    ref = x @ w.T
    norm = ref.pow(2).mean().clamp(min=1e-30)
    x_mean = x.abs().mean(0)
    best = (None, None, float("inf"))
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = fake_quant(w * s, group_size, scale_dtype) / s
        err = ((x @ wq.T - ref).pow(2).mean() / norm).item()
        if err < best[2]:
            best = (alpha, s, err)
    return best


def rtn_error(x, weights, group_size: int, scale_dtype) -> float:
    """The relative output error of plain round-to-nearest (alpha = 0), for the progress line."""
    alpha, s, err = search_scales(x, weights, group_size, scale_dtype, n_grid=1)
    return err


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


def scale_layer(layer, inputs: dict, group_size: int, scale_dtype) -> list:
    """Search and fold AWQ scales into `layer` in place; `inputs` maps a linear's name to its
    recorded input `[R, K]`. Returns one (linear names, alpha, rtn error, awq error) per group."""
    import torch

    report = []
    for prev, linears, name in groups(layer):
        x = inputs[name]
        rtn = rtn_error(x, [lin.weight for lin in linears], group_size, scale_dtype)
        alpha, s, err = search_scales(x, [lin.weight for lin in linears], group_size, scale_dtype)
        if isinstance(prev, torch.nn.Linear):
            fold_into_linear(prev, linears, s)
        else:
            fold_into_norm(prev, linears, s)
        names = [n for n, m in layer.named_modules() if any(m is lin for lin in linears)]
        report.append((names, alpha, rtn, err))
    return report
