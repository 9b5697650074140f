"""The LM head's input range per channel, from the calibration samples, for the int8 head's smoothing.

Why: the int8 LM head (DLINFER_LM_HEAD, framework/lmdeploy_ext/backend/lm_head.py) quantises its
input per token, and a few channels of the final norm's output are much larger than the rest,
so one per-token scale rounds the others coarsely. SmoothQuant's remedy, applied to the head
alone: divide input channel j by s_j and multiply weight column j by s_j (the float product is
unchanged), with s_j = max|x_j|^0.5 / max|w_j|^0.5, which evens out both sides' ranges before
rounding. The weight side is known when the head is built; the input side needs the calibration
activations, which only `python -m dlinfer quantize` has: it writes them here.

Measured on SmolLM2-135M float32 (docs/quantize.md): the int8 head's perplexity cost on the three
held-out texts +1.20% / +0.57% / +0.30% plain, +0.30% / +0.13% / -0.16% smoothed this way (the
norm weight standing in for the input range instead: worse than plain).

The file `DST/lm_head_input_absmax.safetensors` holds float32 `input_absmax` [hidden_size]: the
largest |x_j| of the head's input (the final norm's output) over every calibration token,
metadata {"format": "dlinfer-lm-head-input-absmax-v1"}.
"""

from __future__ import annotations

from pathlib import Path

FORMAT = "dlinfer-lm-head-input-absmax-v1"
FILE_NAME = "lm_head_input_absmax.safetensors"
NAME = "input_absmax"
ALPHA = 0.5  # the input's share of the smoothing exponent (SmoothQuant's alpha)


def absmax(head_input):
    """head_input [..., H] -> float32 [H]: max |x_j| over every token."""
    return head_input.detach().abs().reshape(-1, head_input.shape[-1]).amax(0).float()


def save(path: Path, values) -> None:
    from safetensors.torch import save_file

    save_file({NAME: values.float().contiguous()}, str(path), metadata={"format": FORMAT})


def load(folder, hidden_size: int):
    """The float32 [hidden_size] ranges of `folder`/FILE_NAME, or None when the folder has none; a
    ValueError naming the file when it is not what `save` writes (wrong format, shape, or a value
    that is negative, NaN or infinite)."""
    import torch
    from safetensors import safe_open

    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        fmt = (f.metadata() or {}).get("format")
        if fmt != FORMAT or NAME not in f.keys():
            raise ValueError(f"{path}: expected a tensor {NAME!r} with format {FORMAT!r}, got format {fmt!r} and "
                             f"tensors {sorted(f.keys())}")
        values = f.get_tensor(NAME)
    if values.dtype != torch.float32 or tuple(values.shape) != (hidden_size,):
        raise ValueError(f"{path}: {NAME} must be float32 [{hidden_size}] (the model's hidden size), got "
                         f"{values.dtype} {list(values.shape)}")
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ValueError(f"{path}: {NAME} must hold finite values >= 0")
    return values


def smoothing(input_absmax, weight):
    """The per-channel factors s [H] float32 for a head `weight [V, H]` and its input's ranges:
    s_j = max|x_j|^ALPHA / max_v|w_vj|^(1 - ALPHA); a channel that is zero on either side gets 1
    (nothing to balance)."""
    import torch

    wmax = weight.detach().abs().amax(0).float()
    xmax = input_absmax.float().to(wmax.device)
    live = (xmax > 0) & (wmax > 0)
    s = torch.where(live, xmax.clamp_min(1e-30) ** ALPHA / wmax.clamp_min(1e-30) ** (1 - ALPHA), torch.ones_like(wmax))
    return s
