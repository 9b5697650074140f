"""AWQ's weight-clipping search, run after the scale search: each 4-bit group's range [min, max]
may shrink to [r * min, r * max] (the weights outside it clamped), r on the grid 1.0, 0.975, ...,
0.5 (`N_GRID` steps), trading a coarser clamp of a few large weights for a finer step on all the others.

The objective is the linear's output error on the calibration inputs, measured through their
Gram matrix `C = x^T x / R [K, K]`: for output channel n with quantisation error `d_n = Q(w'_n) -
w_n` (w' the clipped weights, the error against the unclipped ones), the error is `d_n C d_n^T`.
A group's error depends on its own ratio only through `d_n`, so the search is done per (output
channel, group): first each group alone (`C`'s diagonal block, the objective AutoAWQ uses), then
`SWEEPS` coordinate-descent passes over the groups on the whole output channel (the cross-group
terms of `C` included), each step keeping a ratio only when it lowers that error. r = 1 is on the
grid, so the result never does worse than no clipping on the objective. Every linear is clipped,
q/k included (AutoAWQ skips them because their error reaches the output through the softmax, which
this objective ignores; on SmolLM2-135M clipping them lowered the held-out perplexity,
docs/benchmarks.md); `skip` can still leave some out."""

from __future__ import annotations

N_GRID = 20         # ratio steps from 1.0 down to MIN_RATIO
MIN_RATIO = 0.5
SWEEPS = 2
SKIP = ()           # linear names (last path part) never clipped


def ratios(n_grid: int = N_GRID, min_ratio: float = MIN_RATIO) -> list[float]:
    """The grid, 1.0 first: [1.0, ..., min_ratio] (n_grid + 1 points)."""
    return [1.0 - (1.0 - min_ratio) * i / n_grid for i in range(n_grid + 1)]


def clamp_groups(w, group_size: int, ratio):
    """`w [N, K]` with group (n, j)'s values clamped to [ratio * min, ratio * max] of that group,
    `ratio [N, K/g]` (or a float); the clamped group's range lies inside the original one."""
    import torch

    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    ratio = torch.as_tensor(ratio, dtype=torch.float32)
    if ratio.dim() == 2:
        ratio = ratio[..., None]
    hi, lo = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    return torch.minimum(torch.maximum(g, lo * ratio), hi * ratio).reshape(n, k)


def gram(x):
    """`x [R, K]` -> `x^T x / R [K, K]` (float64 accumulation, returned float32)."""
    x = x.double()
    return (x.T @ x / x.shape[0]).float()


def output_error(d, c):
    """Per output channel `d_n C d_n^T` for `d [N, K]`, `c [K, K]` -> `[N]`."""
    return ((d @ c) * d).sum(-1)


def search_clip(x, w, group_size: int, scale_dtype, n_grid: int = N_GRID, min_ratio: float = MIN_RATIO,
                sweeps: int = SWEEPS):
    """(ratio [N, K/g] float32, relative output error without clipping, with it) for `x [R, K]`,
    `w [N, K]`; relative error = sum_n d_n C d_n^T / sum_n w_n C w_n^T."""
    import torch

    from dlinfer.quantize.awq import fake_quant

    n, k = w.shape
    ng = k // group_size
    w = w.float()
    c = gram(x)
    grid = ratios(n_grid, min_ratio)
    # d[i]: the quantisation error of every group at ratio grid[i], [N, G, g]
    d = torch.stack([(fake_quant(clamp_groups(w, group_size, r), group_size, scale_dtype) - w)
                     .reshape(n, ng, group_size) for r in grid])
    blocks = torch.stack([c[j * group_size:(j + 1) * group_size, j * group_size:(j + 1) * group_size]
                          for j in range(ng)])                                   # [G, g, g]
    alone = torch.einsum("rngi,gij,rngj->rng", d, blocks, d)                     # [R_grid, N, G]
    choice = alone.argmin(0)                                                     # [N, G]
    cur = torch.gather(d, 0, choice[None, ..., None].expand(1, n, ng, group_size))[0]   # [N, G, g]
    e = cur.reshape(n, k) @ c                                                    # d C, [N, K]
    rows = torch.arange(n)
    for _ in range(sweeps):
        for j in range(ng):
            sl = slice(j * group_size, (j + 1) * group_size)
            delta = d[:, :, j] - cur[None, :, j]                                 # [R_grid, N, g]
            change = 2 * (delta * e[None, :, sl]).sum(-1) + ((delta @ blocks[j]) * delta).sum(-1)
            best = change.argmin(0)                                              # [N]
            keep = change[best, rows] < 0
            best = torch.where(keep, best, choice[:, j])
            step = d[best, rows, j] - cur[:, j]                                  # [N, g]
            e += step @ c[sl, :]
            cur[:, j] = d[best, rows, j]
            choice[:, j] = best
    ref = output_error(w, c).sum().clamp(min=1e-30)
    before = (output_error(d[0].reshape(n, k), c).sum() / ref).item()
    after = (output_error(cur.reshape(n, k), c).sum() / ref).item()
    ratio = torch.tensor(grid, dtype=torch.float32)[choice]
    return ratio, before, after


def clip_layer(layer, inputs: dict, group_size: int, scale_dtype, skip=SKIP) -> list:
    """Search and apply the clipping of each linear of `layer` (in place) but those whose name
    ends with one in `skip`; `inputs` maps a linear's name (walk.LINEARS) to its recorded input
    `[R, K]`. Returns one (name, error before, error after, mean ratio) per clipped linear."""
    import torch

    report = []
    for name, x in inputs.items():
        if name.endswith(":out") or name.rsplit(".", 1)[-1] in skip:
            continue
        linear = layer.get_submodule(name)
        ratio, before, after = search_clip(x, linear.weight.detach(), group_size, scale_dtype)
        with torch.no_grad():
            linear.weight.copy_(clamp_groups(linear.weight, group_size, ratio).to(linear.weight.dtype))
        report.append((name, before, after, ratio.mean().item()))
    return report
