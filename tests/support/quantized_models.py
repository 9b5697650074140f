"""Tiny checkpoints quantised by `python -m dlinfer quantize`, and the fake-quant HF references
the LMDeploy tests compare them with. The references are built here from the written files with
this file's own unpacking and rounding code (never dlinfer.quantize's):

- AWQ: W[k, c] = (q[k, c] - z[k // g, c]) * s[k // g, c], the nibbles read from LMDeploy's gemm
  layout (column 8j + ORDER[i] in bits 4i..4i+3 of int32 j);
- SmoothQuant: W = q * scale per output channel, and every quantised linear's input fake-quantised
  per token: x -> clamp(round(x / s), -128, 127) * s, s = max|x| / 127 (the dynamic_quant rule);
- the int8 LM head (DLINFER_LM_HEAD, which `auto` turns on for both formats): the head's weight
  fake-quantised per output row by that rule, and its input per token.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from support.engine_helpers import HFReference
from support.tiny_models import CACHE_ROOT, cached_folder, tiny_model

QUANTIZE_SOURCES = Path(__file__).resolve().parents[2] / "dlinfer" / "quantize"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def layer_linears(config) -> tuple:
    """The quantised linears of one decoder layer: a Mixtral layer's attention and each expert's
    w1/w3/w2 (its router stays float), or the seven of a dense layer."""
    experts = (config.get("num_local_experts") if isinstance(config, dict)
               else getattr(config, "num_local_experts", None))
    if not experts:
        return LINEARS
    return LINEARS[:4] + tuple(f"block_sparse_moe.experts.{e}.{w}" for e in range(experts) for w in ("w1", "w2", "w3"))


def quantized_model(name: str, method: str, **options) -> Path:
    """Tiny model `name` quantised by the command (cached, keyed by dlinfer/quantize's sources)."""
    from dlinfer.quantize.cli import quantize

    src = tiny_model(name)
    blob = hashlib.sha256()
    for path in sorted(QUANTIZE_SOURCES.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".txt"):
            blob.update(path.read_bytes())
    blob.update(json.dumps([src.name, method, options], sort_keys=True).encode())
    folder = CACHE_ROOT / "quantized" / f"{name}-{method}-{blob.hexdigest()[:12]}"

    def build(staging: Path) -> None:
        quantize(src, staging, method, log=lambda line: None, **options)

    return cached_folder(folder, build)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] -> int64 [R, N] nibbles 0..15."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    r, n8 = packed.shape
    out = torch.empty(r, n8 * 8, dtype=torch.int64)
    for i, col in enumerate(_NIBBLE_ORDER):
        out[:, col::8] = (words >> (4 * i)) & 0xF
    return out


def dequantized_state(folder: Path) -> tuple[dict, dict]:
    """(HF config dict without quantization_config, float32 state dict) of a quantised folder."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    quant = config.pop("quantization_config")
    stored = load_file(str(folder / "model.safetensors"))
    state = {}
    for key, value in stored.items():
        prefix, leaf = key.rsplit(".", 1)
        if leaf in ("qweight", "qzeros", "scales", "scale") or (leaf == "weight" and value.dtype == torch.int8):
            continue
        state[key] = value.float()
    layers = config["num_hidden_layers"]
    for i in range(layers):
        for linear in layer_linears(config):
            p = f"model.layers.{i}.{linear}"
            if quant["quant_method"] == "awq":
                g = quant["group_size"]
                q = unpack_awq(stored[p + ".qweight"])                    # [K, N]
                z = unpack_awq(stored[p + ".qzeros"]).repeat_interleave(g, 0)
                s = stored[p + ".scales"].double().repeat_interleave(g, 0)
                state[p + ".weight"] = ((q - z).double() * s).T.float().contiguous()
            else:
                assert stored[p + ".weight"].dtype == torch.int8
                state[p + ".weight"] = (stored[p + ".weight"].double() * stored[p + ".scale"].double()).float()
    return config, state


def _fake_quant_per_token(module, args):
    x = args[0]
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.clamp(torch.round(x / s), -128, 127) * s,) + tuple(args[1:])


def _fake_quant_per_group(group_size: int):
    """A pre-hook quantising a linear's input as DLINFER_CPU_W4_ACTIVATIONS=int8 does (written from
    docs/design.md, "W4 with 8-bit activations"): per row and group of `group_size` input
    channels, d = round-half-even(x * float32(127 / absmax)) (the product in float32), x -> d *
    (absmax / 127); all-zero groups stay zero."""

    def hook(module, args):
        x = args[0]
        shape = x.shape
        xf = x.float().reshape(-1, shape[-1] // group_size, group_size)
        amax = xf.abs().amax(-1, keepdim=True)
        r = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
        d = torch.round(xf * r)
        return ((d.double() * (amax / 127).double()).to(x.dtype).reshape(shape),) + tuple(args[1:])

    return hook


def _fake_quant_per_group16(group_size: int):
    """A pre-hook quantising a linear's input as DLINFER_CPU_W4_ACTIVATIONS=int16 does (written from
    docs/design.md, "W4 with 16-bit activations"): per row and group of `group_size` input channels,
    e = the exponent of the group's largest |x| (amax < 2^e, at least -135), x -> round-half-even(x *
    2^(14 - e)) * 2^(e - 14), in float64 (exact: powers of two); all-zero groups stay zero."""

    def hook(module, args):
        x = args[0]
        shape = x.shape
        xd = x.double().reshape(-1, shape[-1] // group_size, group_size)
        e = torch.frexp(xd.abs().amax(-1, keepdim=True)).exponent.clamp(min=-135).double()
        xq = torch.round(xd * torch.exp2(14 - e)) * torch.exp2(e - 14)
        return (xq.to(x.dtype).reshape(shape),) + tuple(args[1:])

    return hook


ACTIVATION_HOOKS = {"int8": _fake_quant_per_group, "int16": _fake_quant_per_group16}


def head_input_ranges(folder: Path):
    """The float32 [H] ranges a quantised folder's `lm_head_input_absmax.safetensors` holds, or None.
    Read here with safetensors directly (the file's layout: docs/quantize.md)."""
    from safetensors.torch import load_file

    path = Path(folder) / "lm_head_input_absmax.safetensors"
    return load_file(str(path))["input_absmax"] if path.is_file() else None


def fake_quant_lm_head(model, input_absmax=None) -> None:
    """Make an HF model's LM head compute what the int8 head computes: the weight rounded per output
    row, w -> q * s with s = float32(max|w_row| / 127), q = clamp(round(w / s), -128, 127) (half to
    even; a zero row stays zero), and the head's input fake-quantised per token. A tied head gets
    its own rounded copy: the embedding table used for lookups stays float.

    With `input_absmax` ([H], the head input's calibration ranges) the head is smoothed first:
    c_j = xmax_j^0.5 / wmax_j^0.5 in float32 (1 where either is 0), the weight's column j times c_j
    (float32) before the rounding, the input times float32(1 / c_j) before its quantisation."""
    w = model.lm_head.weight.detach().float()
    pre = []
    if input_absmax is not None:
        xmax, wmax = input_absmax.float(), w.abs().amax(0)
        c = torch.ones_like(wmax)
        live = (xmax > 0) & (wmax > 0)
        c[live] = xmax[live] ** 0.5 / wmax[live] ** 0.5
        w = w * c
        inv = 1.0 / c
        pre.append(lambda module, args: (args[0] * inv,) + tuple(args[1:]))
    w = w.double()
    s = (w.abs().amax(-1, keepdim=True) / 127).float().double()
    q = torch.clamp(torch.round(w / torch.where(s == 0, torch.ones_like(s), s)), -128, 127)
    model.lm_head.weight = torch.nn.Parameter((q * s).float(), requires_grad=False)
    for hook in pre:
        model.lm_head.register_forward_pre_hook(hook)
    model.lm_head.register_forward_pre_hook(_fake_quant_per_token)


def fake_quant_lm_head_int4(model, input_absmax=None, group_size: int = 32, scale_dtype=torch.float16) -> None:
    """Make an HF model's LM head compute what the int4 head computes: the weight [V, H] rounded to
    4 bits per group of `group_size` input channels, asymmetric. For a clipping ratio r, with lo, hi
    the group's min and max times r: s = (hi - lo) / 15 (at least 1e-5 / 15) in float32 rounded to
    `scale_dtype` (float16 for a float32 or float16 head, bfloat16 for a bfloat16 one),
    z = clamp(round(-lo / s), 0, 15), q = clamp(round(w / s) + z, 0, 15), w -> (q - z) * s (half to
    even, float32 as LMDeploy's AWQ format defines it). r = 1
    without `input_absmax`; with it ([H], the input's ranges) the first r of 1, 0.975, ..., 0.8 whose
    sum over the group of input_absmax_j^2 * ((q - z) * s - w_j)^2 (float32) is least. The input
    stays float and is never smoothed. A tied head gets its own rounded copy."""
    w = model.lm_head.weight.detach().float()
    v, h = w.shape
    groups = w.reshape(v, h // group_size, group_size)
    lo1, hi1 = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    ratios = [1.0] if input_absmax is None else [1.0 - 0.025 * i for i in range(9)]
    imp = None if input_absmax is None else (input_absmax.float() ** 2).reshape(1, h // group_size, group_size)
    best, best_err = None, None
    for r in ratios:
        lo, hi = lo1 * r, hi1 * r
        s = ((hi - lo).clamp(min=1e-5) / 15).to(scale_dtype).float()
        z = torch.clamp(torch.round(-lo / s), 0, 15)
        q = torch.clamp(torch.round(groups / s) + z, 0, 15)
        deq = (q - z) * s
        if imp is None:
            best = (q - z).double() * s.double()
            break
        err = ((deq - groups) ** 2 * imp).sum(-1, keepdim=True)
        if best is None:
            best, best_err = (q - z).double() * s.double(), err
        else:
            better = err < best_err
            best = torch.where(better, (q - z).double() * s.double(), best)
            best_err = torch.where(better, err, best_err)
    model.lm_head.weight = torch.nn.Parameter(best.reshape(v, h).float(), requires_grad=False)


class Int4HeadReference(HFReference):
    """HF transformers (float32) of a float checkpoint whose LM head is fake-quantised to 4 bits (above)."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        fake_quant_lm_head_int4(self.model)


class Int8HeadReference(HFReference):
    """HF transformers (float32) of a float checkpoint whose LM head is fake-quantised (above)."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        fake_quant_lm_head(self.model)


class FakeQuantReference(HFReference):
    """HF transformers (float32) running the dequantised weights of a quantised folder; for
    SmoothQuant also the per-token fake quantisation of each quantised linear's input; with
    `int8_head` (what DLINFER_LM_HEAD=auto runs for these checkpoints) the int8 LM head's, with
    `int4_head` (DLINFER_LM_HEAD=int4) the int4 one's; with `activations` "int8" or "int16" (4-bit
    checkpoints, DLINFER_CPU_W4_ACTIVATIONS=int8 / int16) each 4-bit linear's input quantised per row
    and group by that rule (the int4 head's too, per group of 32); "native" leaves them float."""

    def __init__(self, folder: Path, int8_head: bool = True, int4_head: bool = False, activations: str = "native"):
        from transformers import AutoConfig, AutoModelForCausalLM

        config_dict, state = dequantized_state(folder)
        method = json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"]
        config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "architectures"})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        if config.tie_word_embeddings:
            model.tie_weights()
        if method == "smooth_quant":
            for layer in model.model.layers:
                for linear in layer_linears(config):
                    layer.get_submodule(linear).register_forward_pre_hook(_fake_quant_per_token)
        elif activations != "native":
            group = json.loads((folder / "config.json").read_text())["quantization_config"]["group_size"]
            for layer in model.model.layers:
                for linear in layer_linears(config):
                    layer.get_submodule(linear).register_forward_pre_hook(ACTIVATION_HOOKS[activations](group))
        if int4_head:
            fake_quant_lm_head_int4(model, head_input_ranges(folder))
            if activations != "native":  # the int4 head runs weight_quant_matmul too: its input per group of 32
                model.lm_head.register_forward_pre_hook(ACTIVATION_HOOKS[activations](32))
        elif int8_head:
            fake_quant_lm_head(model, head_input_ranges(folder))
        model.generation_config.eos_token_id = None
        self.model = model.eval()
        self._memo = {}
