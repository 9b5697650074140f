"""quant_policy=8 (the int8 KV cache) on dlinfer's device types: the static scales and the
per-step `quant_meta` LMDeploy's dlinfer attention layer reads (written against LMDeploy 0.18.0).

The scales file. A model folder run with quant_policy=8 holds `kv_int8_scales.safetensors`
(written by `python -m dlinfer quantize SRC DST --method ... --kv-int8`): float32 tensors
`k_scale`, `k_zero`, `v_scale`, `v_zero`, each [num_hidden_layers, num_key_value_heads], and the
metadata {"format": "dlinfer-kv-int8-v1"}. Layer l, KV head h stores
clamp(round(x / scale[l, h] + zero[l, h]), -128, 127) and reads back (q - zero) * scale
(dlinfer/ops/kv_quant.py).

How it reaches the ops. LMDeploy's `DlinferAttentionImpl.forward` (backends/dlinfer/attention.py:
97-105) takes `next(...)` of `attn_metadata.quant_meta['k_scales' | 'k_zeros' | 'v_scales' |
'v_zeros' | 'kv_scales' | 'kv_zeros']` once per attention layer, in layer order, and passes them
to fill_kv_cache ([k_scale, k_zero]) and the paged attention ops (kv_scales [2, Hkv] K then V).
Ascend keeps one `itertools.cycle` per key for the process; here every step gets fresh
iterators over the per-layer tensors (`KVInt8Scales.quant_meta`), so a step always starts at
layer 0 and a step that asked for more layers than the model has would raise StopIteration
instead of silently shifting every later layer's scales. The scales are loaded once per engine,
before any weight (`load_for_engine`, called from the model agent patch), and kept on the
engine's `ModelConfig`, which every step context carries: no process-global state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List

import torch

from dlinfer.quantize.kv_scales import FILE_NAME as SCALES_FILE  # the writer's definitions of the file
from dlinfer.quantize.kv_scales import FORMAT, NAMES

QUANTIZE_COMMAND = "python -m dlinfer quantize SRC DST --method ... --kv-int8"
_ATTR = "_dlinfer_kv_int8_scales"  # on the engine's ModelConfig


class KVScalesError(ValueError):
    """The scales file of quant_policy=8 is missing or does not fit the model."""


class LayerIterator:
    """An iterator over per-layer tensors, layer 0 first, that torch.compile can trace: Dynamo 2.13
    cannot call next() on a list iterator handed to a compiled function ("Missing tp_iternext"),
    but it follows a Python __next__. Graph mode's decode steps read the scales through it."""

    def __init__(self, items: List[torch.Tensor]):
        self.items = items
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self.index >= len(self.items):
            raise StopIteration
        item = self.items[self.index]
        self.index += 1
        return item


@dataclass(frozen=True)
class KVInt8Scales:
    """Per layer, float32 on the engine's device: k/v scale and zero [Hkv] and the [2, Hkv] pairs."""

    k_scales: List[torch.Tensor]
    k_zeros: List[torch.Tensor]
    v_scales: List[torch.Tensor]
    v_zeros: List[torch.Tensor]
    kv_scales: List[torch.Tensor]
    kv_zeros: List[torch.Tensor]

    def quant_meta(self) -> Dict[str, object]:
        """One step's `attn_metadata.quant_meta`: a fresh iterator per key, layer 0 first."""
        it = LayerIterator
        return {"k_scales": it(self.k_scales), "k_zeros": it(self.k_zeros), "v_scales": it(self.v_scales),
                "v_zeros": it(self.v_zeros), "kv_scales": it(self.kv_scales), "kv_zeros": it(self.kv_zeros)}


def read_scales(model_path: str, num_layers: int, num_kv_heads: int) -> Dict[str, torch.Tensor]:
    """The four [num_layers, num_kv_heads] float32 tensors of `model_path`/kv_int8_scales.safetensors,
    checked (format, names, shapes, dtypes, finite, scales > 0); KVScalesError otherwise."""
    from safetensors import safe_open

    path = os.path.join(model_path, SCALES_FILE)
    if not os.path.isfile(path):
        raise KVScalesError(f"quant_policy=8 needs the int8 KV cache's scales: {path} does not exist. Write it with "
                            f"`{QUANTIZE_COMMAND}` (docs/lmdeploy.md, 'quant_policy=8').")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise KVScalesError(f"{path}: metadata format {meta.get('format')!r}, expected {FORMAT!r}.")
        missing = [n for n in NAMES if n not in f.keys()]
        if missing:
            raise KVScalesError(f"{path}: no tensor {missing}; expected {list(NAMES)}.")
        out = {n: f.get_tensor(n) for n in NAMES}
    for name, t in out.items():
        if t.dtype != torch.float32 or tuple(t.shape) != (num_layers, num_kv_heads):
            raise KVScalesError(f"{path}: {name} is {t.dtype} {list(t.shape)}, expected float32 "
                                f"[num_hidden_layers={num_layers}, num_key_value_heads={num_kv_heads}].")
        if not bool(torch.isfinite(t).all()) or (name.endswith("scale") and bool((t <= 0).any())):
            raise KVScalesError(f"{path}: {name} must be finite{' and > 0' if name.endswith('scale') else ''}.")
    return out


def build_scales(tensors: Dict[str, torch.Tensor], device: str) -> KVInt8Scales:
    k_s, k_z, v_s, v_z = (tensors[n].to(device) for n in NAMES)
    layers = range(k_s.shape[0])
    return KVInt8Scales(
        k_scales=[k_s[i].contiguous() for i in layers], k_zeros=[k_z[i].contiguous() for i in layers],
        v_scales=[v_s[i].contiguous() for i in layers], v_zeros=[v_z[i].contiguous() for i in layers],
        kv_scales=[torch.stack([k_s[i], v_s[i]]) for i in layers],
        kv_zeros=[torch.stack([k_z[i], v_z[i]]) for i in layers])


def load_for_engine(model_path: str, model_config, cache_config, device: str) -> None:
    """For quant_policy=8: read the scales file (KVScalesError naming it when missing or wrong) and
    keep the per-layer scales on `model_config` for `quant_meta_of`. Does nothing otherwise."""
    if int(cache_config.quant_policy) != 8:
        return
    tensors = read_scales(model_path, model_config.num_layers, model_config.num_key_value_heads)
    object.__setattr__(model_config, _ATTR, build_scales(tensors, device))


def quant_meta_of(step_context):
    """The step's `quant_meta` (None unless quant_policy=8)."""
    if int(step_context.kv_quant_policy) != 8:
        return None
    scales = getattr(step_context.model_config, _ATTR, None)
    if scales is None:
        raise KVScalesError("quant_policy=8 but no int8 KV scales were loaded for this engine "
                            f"({SCALES_FILE} is read when the model agent is built).")
    return scales.quant_meta()
