"""AWQ's weight-clipping search (dlinfer/quantize/awq_clip.py): on a linear with outlier weights it
lowers the output error, measured here in float64 from the stored bytes (unpacked and
dequantised by this file's own code), never widens a group's range, and clips q/k unless skipped."""

from __future__ import annotations

import torch
from support.quantized_models import unpack_awq  # noqa: E402

from dlinfer.quantize import awq_clip, pack  # noqa: E402

G = 32


def _stored_weight(w: torch.Tensor) -> torch.Tensor:
    """float64 [N, K]: what a loader dequantises from the bytes pack.awq_tensors writes for `w`."""
    t = pack.awq_tensors(w, G, torch.float16)
    q = unpack_awq(t["qweight"]).double()                                # [K, N]
    z = unpack_awq(t["qzeros"]).double().repeat_interleave(G, 0)
    s = t["scales"].double().repeat_interleave(G, 0)
    return ((q - z) * s).T


def _output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    """||x W^T - x Wq^T||^2 / ||x W^T||^2 in float64."""
    x, w = x.double(), w.double()
    ref = x @ w.T
    return ((x @ wq.T - ref).pow(2).sum() / ref.pow(2).sum()).item()


def _layer_with_outliers(seed: int = 0):
    """A module holding linears named like a decoder layer's, Gaussian weights (std 0.02) with
    outliers of 5 std (one in every other group on average), and their inputs [R, K]."""
    torch.manual_seed(seed)
    n, k = 64, 128
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    inputs = {}
    for parent, name in ((layer.mlp, "down_proj"), (layer.self_attn, "k_proj")):
        lin = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k) * 0.02)
            rows, cols = torch.randint(0, n, (n * k // (2 * G),)), torch.randint(0, k, (n * k // (2 * G),))
            lin.weight[rows, cols] = 0.1 * torch.sign(torch.randn(rows.shape))
        setattr(parent, name, lin)
        prefix = "mlp." if parent is layer.mlp else "self_attn."
        inputs[prefix + name] = torch.randn(256, k) * (torch.rand(k) + 0.5)
    return layer, inputs


def test_clipping_lowers_the_output_error_of_the_stored_weights():
    layer, inputs = _layer_with_outliers()
    w0 = layer.mlp.down_proj.weight.detach().clone()
    x = inputs["mlp.down_proj"]
    before = _output_error(x, w0, _stored_weight(w0))
    report = awq_clip.clip_layer(layer, inputs, G, torch.float16)
    after = _output_error(x, w0, _stored_weight(layer.mlp.down_proj.weight.detach()))
    assert after < 0.9 * before, (before, after)
    # on fresh inputs of the same distribution too (not only the calibration rows)
    torch.manual_seed(5)
    fresh = torch.randn(256, x.shape[1]) * x.std(0)
    assert _output_error(fresh, w0, _stored_weight(layer.mlp.down_proj.weight.detach())) < \
        _output_error(fresh, w0, _stored_weight(w0))
    (name, rel_before, rel_after, mean_ratio), = [r for r in report if r[0] == "mlp.down_proj"]
    assert rel_after < rel_before and 0.5 <= mean_ratio < 1.0


def test_clipped_range_never_exceeds_the_unclipped_one():
    layer, inputs = _layer_with_outliers(seed=3)
    w0 = layer.mlp.down_proj.weight.detach().clone()
    awq_clip.clip_layer(layer, inputs, G, torch.float16)
    w1 = layer.mlp.down_proj.weight.detach()
    g0, g1 = w0.view(w0.shape[0], -1, G), w1.view(w1.shape[0], -1, G)
    assert (g1.amax(-1) <= g0.amax(-1)).all() and (g1.amin(-1) >= g0.amin(-1)).all()
    assert not torch.equal(w0, w1)  # something was clipped
    # the stored step (float16 scale) is never coarser than the unclipped one's
    s0 = pack.awq_tensors(w0, G, torch.float16)["scales"]
    s1 = pack.awq_tensors(w1, G, torch.float16)["scales"]
    assert (s1 <= s0).all()


def test_q_and_k_are_clipped_unless_skipped():
    layer, inputs = _layer_with_outliers()
    w0 = layer.self_attn.k_proj.weight.detach().clone()
    report = awq_clip.clip_layer(layer, inputs, G, torch.float16)
    assert not torch.equal(layer.self_attn.k_proj.weight, w0)
    assert sorted(r[0] for r in report) == ["mlp.down_proj", "self_attn.k_proj"]
    layer, inputs = _layer_with_outliers()
    w0 = layer.self_attn.k_proj.weight.detach().clone()
    report = awq_clip.clip_layer(layer, inputs, G, torch.float16, skip=("q_proj", "k_proj"))
    assert torch.equal(layer.self_attn.k_proj.weight, w0)
    assert [r[0] for r in report] == ["mlp.down_proj"]


def test_clamp_groups_ratio_one_is_identity_and_grid_starts_at_one():
    w = torch.randn(8, 64)
    assert torch.equal(awq_clip.clamp_groups(w, G, 1.0), w)
    grid = awq_clip.ratios()
    assert grid[0] == 1.0 and abs(grid[-1] - awq_clip.MIN_RATIO) < 1e-9 and grid == sorted(grid, reverse=True)
