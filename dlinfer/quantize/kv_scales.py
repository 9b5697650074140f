"""Static int8 KV-cache scales per layer and KV head, from the calibration activations.

The file `DST/kv_int8_scales.safetensors` holds float32 `k_scale`, `k_zero`, `v_scale`, `v_zero`,
each `[num_hidden_layers, num_key_value_heads]`, metadata {"format": "dlinfer-kv-int8-v1"}.
A cached value x of layer l, head h is stored as q = clamp(round(x / scale + zero), -128, 127)
and read back as (q - zero) * scale; scale and zero map the calibration range [min, max] of
that head onto [-128, 127]. K is measured after the rotary embedding (what the cache holds)."""

from __future__ import annotations

FORMAT = "dlinfer-kv-int8-v1"
FILE_NAME = "kv_int8_scales.safetensors"
NAMES = ("k_scale", "k_zero", "v_scale", "v_zero")  # the file's tensors (the adaptor reads these)


def rotate(k, cos, sin):
    """HF's rotary embedding (rotate_half convention) of `k [S, T, H, D]`; cos/sin `[S or 1, T, D]`."""
    import torch

    half = k.shape[-1] // 2
    rot = torch.cat((-k[..., half:], k[..., :half]), -1)
    return k * cos[:, :, None, :] + rot * sin[:, :, None, :]


def head_ranges(k_out, v_out, kwargs, num_kv_heads: int):
    """(k_min, k_max, v_min, v_max), each float32 [Hkv], of one layer's k_proj / v_proj outputs
    `[S, T, Hkv * D]`, K rotated by the layer's position embeddings."""
    s, t, _ = k_out.shape
    k = k_out.float().reshape(s, t, num_kv_heads, -1)
    v = v_out.float().reshape(s, t, num_kv_heads, -1)
    cos, sin = kwargs["position_embeddings"]
    k = rotate(k, cos.float(), sin.float())
    dims = (0, 1, 3)
    return k.amin(dims), k.amax(dims), v.amin(dims), v.amax(dims)


def scale_zero(lo, hi):
    """(scale, zero) float32 mapping [lo, hi] onto [-128, 127] (a range that excludes 0 is widened to it)."""
    import torch

    lo = torch.minimum(lo, torch.zeros_like(lo))
    hi = torch.maximum(hi, torch.zeros_like(hi))
    scale = ((hi - lo) / 255).clamp(min=1e-8)
    zero = -128 - lo / scale
    return scale.float(), zero.float()


def save(path, ranges: list) -> None:
    """Write the scales file from one head_ranges() tuple per layer."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for prefix, (lo_i, hi_i) in (("k", (0, 1)), ("v", (2, 3))):
        lo = torch.stack([r[lo_i] for r in ranges])
        hi = torch.stack([r[hi_i] for r in ranges])
        scale, zero = scale_zero(lo, hi)
        tensors[f"{prefix}_scale"] = scale.contiguous()
        tensors[f"{prefix}_zero"] = zero.contiguous()
    save_file(tensors, str(path), metadata={"format": FORMAT})
