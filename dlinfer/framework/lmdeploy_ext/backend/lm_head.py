"""The quantised LM head: `DLINFER_LM_HEAD=int8|int4|float|auto`, applied once after the weights load.

Why: LMDeploy's AWQ and SmoothQuant checkpoint formats leave the LM head in float. For a small
model this is the largest single weight a decode step reads: SmolLM2-135M's tied head is
float32 [49152, 576], 113 MB, more bytes than all its quantised layers together.

What: the head becomes `Int8LMHead`, which runs the existing W8A8 ops (dlinfer/ops/quant.py):
`dynamic_quant(hidden)` (per-token symmetric int8) then `linear_w8a8` against the head weight
quantised once per output row by the same rule (scale = max|w| / 127 in float32, round half to
even, clamp to [-128, 127]; a zero row gets scale 0), logits in the head's float dtype. On the
cpu vendor the int8 product is exact (int32) on its VNNI kernel.

- tied head (its weight shares the embedding table's storage after loading): the float table
  stays for token lookups; the int8 copy is extra (a quarter of float32's bytes). A weight update
  that runs LMDeploy's `update_weights` again re-quantises it from the table.
- untied head: the float weight is freed.
- `auto` (the default): int8 when the checkpoint is quantised (`quant_method` "awq" or
  "smooth_quant"), float otherwise.
- int4 (opt-in, never `auto`'s choice): the head as a W4A16 weight, `weight_quant_matmul` against
  the weight rounded to 4 bits per group of INT4_GROUP input channels (asymmetric, the rounding
  `python -m dlinfer quantize --method rtn` uses: dlinfer/quantize/awq.py `quant_params`; with the
  calibration ranges a clipping search, `int4_rounding`), repacked once to the vendor's layout;
  activations stay float, never smoothed (below). 4.625-4.75 bits a weight in the cpu vendor's
  layouts (scales: `int4_scale_dtype`) where int8 reads 8: a third of a Llama-3.2-1B W4A16 decode
  step's bytes is its int8 head.
  It rounds more than llama.cpp's usual head (Q6_K in its Q4_0 / Q4_K_M files): the perplexity it
  costs is in docs/lmdeploy.md.
- smoothing (the int8 head): when the model folder holds the head input's calibration ranges
  (`lm_head_input_absmax.safetensors`, written by `python -m dlinfer quantize`;
  dlinfer/quantize/head_stats.py), input channel j is divided by s_j and weight column j
  multiplied by it before either is rounded (s from `head_stats.smoothing`): the head's rounding
  error falls (SmolLM2 float32: +0.6% perplexity -> +0.1%, three texts' mean) for one [H] multiply a
  step. Without the file,
  no smoothing.

tp > 1: LMDeploy 0.18 builds the LM head unsplit (`build_rowwise_linear(..., is_tp=False)`,
models/llama.py, models/utils/model.py `build_lm_head`): every rank holds the whole head and
computes every logit, so every rank quantises its own copy the same way and the int8 head runs
unchanged. Graph mode: LMDeploy computes logits outside the model's forward (`get_logits`), so the
head runs eagerly in both modes.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

import dlinfer.ops
from dlinfer import envs
from dlinfer.quantize import head_stats

ENV = "DLINFER_LM_HEAD"
CHOICES = ("int8", "int4", "float", "auto")
INT4_GROUP = 32  # input channels a 4-bit group: SmolLM2 float32 +4.6% perplexity at 32, +12.5% at 64
QUANTISED_METHODS = ("awq", "smooth_quant")  # LMDeploy's quant_method names of the formats dlinfer runs
log = logging.getLogger("dlinfer.lmdeploy.lm_head")


def read_option(environ=os.environ) -> str:
    """The value of DLINFER_LM_HEAD ("auto" when unset); a ValueError naming it and the choices."""
    value = envs.get(ENV, environ) or "auto"
    if value.strip().lower() not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)} (unset means auto)")
    return value.strip().lower()


def choose(option: str, quant_method: Optional[str]) -> str:
    """"int8", "int4" or "float": the head an engine gets for `option` and the checkpoint's quant_method."""
    if option == "auto":
        return "int8" if quant_method in QUANTISED_METHODS else "float"
    return option


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, H] float -> (qweight [V, H] int8, scale [V] float32), the dynamic_quant rule per row."""
    qweight, scale = dlinfer.ops.dynamic_quant(weight.detach())
    return qweight.contiguous(), scale.contiguous()


class _QuantisedLMHead(torch.nn.Module):
    """What the int8 and int4 heads share: the smoothing, the tied table, re-quantising after a
    weight update. `weight` is what LMDeploy's code reads of a head: `get_logits` casts the hidden
    states to `lm_head.weight.dtype`, and a tied model's `update_weights` assigns the embedding
    table to it. For a tied head it is that table (a Parameter, shared); for an untied one an
    empty tensor of the head's dtype (the float weight is freed). Subclasses quantise in
    `_quantise(weight [V, H] smoothed)` and compute in `forward`."""

    kind = ""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], tied: bool,
                 smooth: Optional[torch.Tensor] = None):
        super().__init__()
        self.tied = tied
        self.out_dtype = weight.dtype
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        name = type(self).__name__
        if smooth is not None and tuple(smooth.shape) != (self.in_features,):
            raise ValueError(f"{name}: smooth must be [{self.in_features}] (the head's input features), "
                             f"got {list(smooth.shape)}")
        self.smooth = None if smooth is None else smooth.float().to(weight.device)
        # x * inv_smooth in x's dtype (the head's): what runs before the head's product
        self.inv_smooth = None if smooth is None else (1.0 / self.smooth).to(weight.dtype)
        self._quantise(self._smoothed(weight))
        self.bias = bias
        if tied:
            self.weight = weight  # the embedding's Parameter: registered here too, as LMDeploy had it
        else:
            self.register_buffer("weight", weight.new_empty(0), persistent=False)

    def _quantise(self, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def update_weights(self) -> None:
        """Re-quantise a tied head from its (possibly reloaded) table; LMDeploy calls this after
        every weight load, after the model's own `update_weights` has re-tied `weight`."""
        if self.tied and self.weight.numel() > 0:
            self._quantise(self._smoothed(self.weight))

    def _smoothed(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [V, H] with column j times s_j, in float32 (as it is, without smoothing)."""
        return weight if self.smooth is None else weight.detach().float() * self.smooth

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.inv_smooth is None else x * self.inv_smooth

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, tied={self.tied}, "
                f"smoothed={self.smooth is not None}")


class Int8LMHead(_QuantisedLMHead):
    """logits [..., V] = linear_w8a8(dynamic_quant(x [..., H]), qweight [V, H], scale [V]) (+ bias [V]);
    with `smooth` (s [H] float32): dynamic_quant(x * (1/s)) against the rows of weight * s."""

    kind = "int8"

    def _quantise(self, weight: torch.Tensor) -> None:
        qweight, scale = quantize_rows(weight)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xscale = dlinfer.ops.dynamic_quant(self._input(x))
        return dlinfer.ops.linear_w8a8(xq, self.qweight, xscale, self.scale, self.out_dtype, bias=self.bias)


CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(9))  # the int4 head's clipping search: 1.0 .. 0.8
# int4_rounding's float32 temporaries ([rows, H] each) are kept to about this size: rounded 8192 rows
# at a time a 1B head (H = 2048, 64 MB temporaries, past glibc's 32 MB ceiling for reusing freed
# memory, so every one was mapped afresh) took 30.4 s with the clipping search; at 2 MB (256 rows,
# in cache) 3.7-5.4 s (Zen 5 VM), the same tensors.
_CLIP_BYTES = 2 << 20


def _clip_rows(h: int) -> int:
    """Head rows rounded at a time for hidden size h: a multiple of 8 (the packing's), at least 8."""
    return max(8, _CLIP_BYTES // (4 * h) // 8 * 8)


def int4_rounding(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype,
                  importance: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [V, H] -> (q int32 [V, H] in 0..15, zero int32 [V, H/g], scale float32 [V, H/g] holding
    scale_dtype values): asymmetric 4 bits per group of g = group_size input channels. Without
    `importance` the rule of dlinfer/quantize/awq.py `quant_params`; with it ([H] >= 0, a weight
    per input channel) each group takes, of its min and max scaled by each of CLIP_RATIOS (1.0
    first), the pair whose rounding (`awq.round_groups`) has the least sum over the group of
    importance_j * (dequantised - w_j)^2 (ties: the earlier ratio). Holds float32 temporaries of
    the whole `weight`: quantize_groups calls it a few rows at a time (`_clip_rows`)."""
    from dlinfer.quantize.awq import round_groups

    v, h = weight.shape
    g = weight.detach().float().reshape(v, h // group_size, group_size)
    lo0, hi0 = g.amin(-1), g.amax(-1)
    imp = None if importance is None else importance.float().to(weight.device).reshape(1, -1, group_size)
    q, zero, scale = round_groups(g, lo0, hi0, scale_dtype)
    if imp is not None:
        best_err = (((q - zero[..., None]) * scale[..., None] - g) ** 2 * imp).sum(-1)
        for ratio in CLIP_RATIOS[1:]:
            qq, z, s = round_groups(g, lo0 * ratio, hi0 * ratio, scale_dtype)
            err = (((qq - z[..., None]) * s[..., None] - g) ** 2 * imp).sum(-1)
            take = err < best_err
            best_err = torch.where(take, err, best_err)
            q = torch.where(take[..., None], qq, q)
            zero, scale = torch.where(take, z, zero), torch.where(take, s, scale)
    return q.reshape(v, h).to(torch.int32), zero.to(torch.int32), scale


def quantize_groups(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype,
                    importance: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [V, H] float -> (qweight int32 [H, V/8], scales [H/g, V] scale_dtype, qzeros int32
    [H/g, V/8]): `int4_rounding` in the W4A16 op's AWQ layout, before the vendor's repack. Rounded
    and packed `_clip_rows(H)` head rows at a time (a chunk's rows are a slice of V), so the
    transient memory is a chunk's (~2 MB a temporary), not a float32 copy of the whole head."""
    from dlinfer.vendor.w4_layouts import pack

    v, h = weight.shape
    device = weight.device
    qweight = torch.empty(h, v // 8, dtype=torch.int32, device=device)
    scales = torch.empty(h // group_size, v, dtype=scale_dtype, device=device)
    qzeros = torch.empty(h // group_size, v // 8, dtype=torch.int32, device=device)
    rows = _clip_rows(h)
    for r0 in range(0, v, rows):
        r1 = min(v, r0 + rows)
        q, zero, scale = int4_rounding(weight[r0:r1], group_size, scale_dtype, importance)
        qweight[:, r0 // 8:r1 // 8] = pack(q.T.contiguous())
        qzeros[:, r0 // 8:r1 // 8] = pack(zero.T.contiguous())
        scales[:, r0:r1] = scale.T.to(scale_dtype)
    return qweight, scales, qzeros


def int4_scale_dtype(head_dtype: torch.dtype, weight: torch.Tensor) -> torch.dtype:
    """The int4 head's scale dtype: the head's for bfloat16 and float16; for float32 float16 (as
    AWQ checkpoints store them: 4.625 bits a weight instead of 5.125 in the cpu vendor's
    column_tiled layout), unless a group's range would overflow it (max |w| past 2**18)."""
    if head_dtype != torch.float32:
        return head_dtype
    return torch.float16 if float(weight.detach().abs().max()) < 2.0**18 else torch.float32


def int4_refusal(weight: torch.Tensor) -> Optional[str]:
    """None if a head weight [V, H] can be an Int4LMHead, else why not (the packing's constraints)."""
    if weight.shape[0] % 8 or weight.shape[1] % INT4_GROUP:
        return (f"the head [{weight.shape[0]}, {weight.shape[1]}] needs a vocabulary that is a multiple of 8 and "
                f"input features a multiple of {INT4_GROUP}")
    return None


class Int4LMHead(_QuantisedLMHead):
    """logits [..., V] = weight_quant_matmul(x [..., H], the head rounded to 4 bits per group of
    INT4_GROUP input channels) (+ bias [V]), in x's dtype. With `input_absmax` ([H], the head
    input's calibration ranges) each group's clipping is searched with max|x_j|^2 as channel j's
    weight (`int4_rounding`): on SmolLM2's AWQ checkpoint the head's perplexity cost fell from
    +4.5-7.9% to +2.6-3.6% (docs/lmdeploy.md). Never smoothed: the int8 head's smoothing balances
    the input's per-token rounding against the weight's, and this head does not round its input;
    on that checkpoint it made the head's loss 3x worse. The scales are in `int4_scale_dtype`.
    `qweight`, `scales` and `qzeros` are what the vendor's `repack_weight_quant` returned (the cpu
    vendor: its k_interleaved or column_tiled layout; dlinfer/tools/decode_timing.py counts their
    bytes)."""

    kind = "int4"

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], tied: bool,
                 input_absmax: Optional[torch.Tensor] = None):
        if input_absmax is not None and tuple(input_absmax.shape) != (weight.shape[1],):
            raise ValueError(f"Int4LMHead: input_absmax must be [{weight.shape[1]}] (the head's input features), "
                             f"got {list(input_absmax.shape)}")
        self.importance = None if input_absmax is None else input_absmax.detach().float().to(weight.device) ** 2
        super().__init__(weight, bias, tied, smooth=None)

    def _quantise(self, weight: torch.Tensor) -> None:
        why_not = int4_refusal(weight)
        if why_not is not None:
            raise ValueError(f"Int4LMHead: {why_not}")
        qweight, scales, qzeros = quantize_groups(weight, INT4_GROUP, int4_scale_dtype(self.out_dtype, weight),
                                                  self.importance)
        # The hook is given the scales in the head's dtype, as LMDeploy gives a W4 linear's (the cpu
        # vendor reads the model's dtype from them and stores float16-valued ones as float16 again).
        qweight, scales, qzeros = dlinfer.ops.repack_weight_quant(qweight, scales.to(self.out_dtype), qzeros,
                                                                  group_size=INT4_GROUP)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("qzeros", qzeros, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dlinfer.ops.weight_quant_matmul(self._input(x), self.qweight, self.scales, self.qzeros, bias=self.bias,
                                               group_size=INT4_GROUP)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", clipped by the input's ranges={self.importance is not None}"


HEADS = {"int8": Int8LMHead, "int4": Int4LMHead}


def _float_head(module) -> Optional[str]:
    """None if `module` is an LMDeploy float linear a quantised head can replace, else why not."""
    from lmdeploy.pytorch.nn.linear.default import BaseLinear

    if type(module) is not BaseLinear:
        return f"{type(module).__name__} is not LMDeploy's float linear"
    if len(module.lora_adapters) > 0:
        return "it carries LoRA adapters"
    if getattr(module, "is_tp", False):
        return "it is split across tensor-parallel ranks"
    weight = module.weight
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"its weight is {weight.dtype} {list(weight.shape)}"
    return None


def _tied_to(model: torch.nn.Module, name: str, weight: torch.Tensor) -> Optional[torch.nn.Parameter]:
    """The parameter of another module of `model` that holds the head's weight (the embedding table,
    once LMDeploy's `update_weights` tied them), or None. Compared by storage, not identity: the
    head's own `update_weights` re-wraps the tied tensor in a new Parameter."""
    for n, p in model.named_parameters(remove_duplicate=False):
        if not n.startswith(name + ".") and p.data_ptr() == weight.data_ptr() and p.shape == weight.shape:
            return p
    return None


def install(model: torch.nn.Module, input_absmax: Optional[torch.Tensor] = None, kind: str = "int8") -> int:
    """Replace every `lm_head` submodule of `model` (a text model's, a VLM's language model's) by
    the `kind` head (HEADS: "int8" or "int4"); when `input_absmax` ([H], the head input's
    calibration ranges) is given and matches the head's input features, an int8 head is smoothed
    by it and an int4 head's clipping searched with it. Returns how many. A head that cannot be
    replaced stays float, with a warning."""
    if kind not in HEADS:
        raise ValueError(f"install: kind must be one of {', '.join(HEADS)}, got {kind!r}")
    heads = [(name, mod) for name, mod in model.named_modules() if name.rpartition(".")[2] == "lm_head"]
    replaced = 0
    for name, head in heads:
        why_not = _float_head(head)
        if why_not is None and kind == "int4":
            why_not = int4_refusal(head.weight)
        if why_not is not None:
            log.warning("%s=%s: %s stays float: %s", ENV, kind, name, why_not)
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        table = _tied_to(model, name, head.weight)
        tied = table is not None
        weight = table if tied else head.weight
        ranges = None
        if input_absmax is not None:
            if input_absmax.shape[0] == weight.shape[1]:
                ranges = input_absmax
            else:
                log.warning("%s=%s: %s: the input ranges have %d channels, the head %d: not used", ENV, kind, name,
                            input_absmax.shape[0], weight.shape[1])
        if kind == "int8":
            smooth = None if ranges is None else head_stats.smoothing(ranges, weight)
            new_head = Int8LMHead(weight, head.bias, tied, smooth)
        else:
            log.info("%s=int4: rounding %s [%d, %d] to 4 bits%s ...", ENV, name, weight.shape[0], weight.shape[1],
                     ", searching each group's clipping" if ranges is not None else "")
            new_head = Int4LMHead(weight, head.bias, tied, ranges)
        setattr(parent, "lm_head", new_head)
        replaced += 1
        used = "" if ranges is None else f", {'smoothed' if kind == 'int8' else 'clipped'} by the calibration ranges"
        log.info("%s=%s: %s is %s [%d, %d] (%s%s)", ENV, kind, name, kind, new_head.out_features,
                 new_head.in_features,
                 "tied: the float embedding table kept for lookups" if tied else "the float weight freed", used)
    if not heads:
        log.warning("%s=%s: the model has no lm_head; nothing quantised", ENV, kind)
    return replaced


def apply_for_engine(model: torch.nn.Module, model_config, option: str, weights_loaded: bool,
                     model_path: Optional[str] = None) -> str:
    """After the weights load: the head `option` asks for (`choose`), given the ranges in
    `model_path` when it has them (`install`; a bad ranges file is a ValueError naming it); returns
    "int8", "int4" or "float"."""
    quant = getattr(model_config, "quant_config", None)
    head = choose(option, getattr(quant, "quant_method", None))
    if head in HEADS and not weights_loaded:
        log.warning("%s=%s: the engine starts without weights (empty_init); the LM head stays float", ENV, head)
        return "float"
    if head in HEADS:
        ranges = None
        hidden = getattr(model_config, "hidden_size", None)
        if model_path is not None and hidden:
            ranges = head_stats.load(model_path, hidden)
        if install(model, ranges, head) == 0:
            return "float"
    return head
