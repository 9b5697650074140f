"""`python -m dlinfer quantize SRC DST --method awq|rtn|smooth_quant [--group-size G]
[--calib FILE] [--kv-int8] [--no-clip] [--no-tune]` (docs/quantize.md)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "write an AWQ 4-bit or SmoothQuant int8 checkpoint that LMDeploy loads, on CPU (docs/quantize.md)"
METHODS = ("awq", "rtn", "smooth_quant")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path,
                        help="a HF checkpoint folder (Llama or Qwen2 family; Mixtral with smooth_quant)")
    parser.add_argument("dst", type=Path, help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--method", choices=METHODS, required=True,
                        help="awq: 4-bit with the activation-aware scale search; rtn: the same format, plain "
                             "round-to-nearest; smooth_quant: int8 weights and activations")
    parser.add_argument("--group-size", type=int, default=None,
                        help="awq / rtn: group size along K (default: the largest of 128, 64, 32 that divides every "
                             "quantised linear's K and N)")
    parser.add_argument("--calib", type=Path, default=None,
                        help="calibration text file (default: the small corpus shipped in dlinfer/quantize/data)")
    parser.add_argument("--calib-seqlen", type=int, default=128, help="tokens per calibration sample (default 128)")
    parser.add_argument("--calib-samples", type=int, default=64, help="at most this many samples (default 64)")
    parser.add_argument("--no-clip", action="store_true",
                        help="awq: skip the weight-clipping search that follows the scale search")
    parser.add_argument("--no-tune", action="store_true",
                        help="awq: skip the tuning of the group scales and norms (distillation from the float "
                             "model) that ends it")
    parser.add_argument("--tune-steps", type=int, default=None,
                        help="awq: steps of that tuning (default 30; 0 skips it like --no-tune)")
    parser.add_argument("--kv-int8", action="store_true",
                        help="also write static per-layer per-head int8 KV-cache scales (kv_int8_scales.safetensors)")


def _tensor_name(layer_index: int, linear: str, key: str) -> str:
    return f"model.layers.{layer_index}.{linear}.{key}"


def quantize(src: Path, dst: Path, method: str, group_size: int | None = None, calib: Path | None = None,
             kv_int8: bool = False, calib_seqlen: int = 128, calib_samples: int = 64, log=None,
             clip: bool = True, tune_steps: int | None = None) -> dict:
    """Quantise SRC into DST; returns {"layers": [per-layer report lines], "seconds": ...}.
    group_size: awq / rtn (None: source.default_group_size, printed).
    tune_steps: the tuning that ends AWQ (None: distil.STEPS; 0: none; other methods: none)."""
    import torch

    from dlinfer.quantize import awq, awq_clip, distil, head_stats, kv_scales, pack, smooth_quant, source, walk, writer
    from dlinfer.quantize import calib as calibration

    log = log or (lambda text: print(text, flush=True))
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if method not in METHODS:
        raise source.QuantizeInputError(f"quantize: --method must be one of {', '.join(METHODS)}, got {method!r}.")
    config = source.read_config(src)
    if method != "smooth_quant":
        source.check_dense(config, method)
        if group_size is None:
            group_size = source.default_group_size(config)
            log(f"quantize: group size {group_size} (the largest of "
                f"{', '.join(map(str, source.GROUP_SIZES))} that divides every linear's K and N)")
        source.check_group_size(config, group_size)
    tune_steps = (distil.STEPS if tune_steps is None else tune_steps) if method == "awq" else 0
    if tune_steps < 0:
        raise source.QuantizeInputError(f"quantize: --tune-steps must be 0 or more, got {tune_steps}.")
    writer.check_destination(dst)
    writer.clear_interrupted_runs(dst, log)
    dtype = source.load_dtype(config, whole_model_in_float32=bool(tune_steps))
    log(f"quantize: loading {src} ({config['architectures'][0]}, {config['num_hidden_layers']} layers) in "
        f"{str(dtype).replace('torch.', '')}" + ("" if dtype == torch.float32 else ", each layer widened to float32 "
                                                 "while it is quantised"))
    model, tokenizer = source.load(src, dtype)
    ids = calibration.samples(tokenizer, calib, calib_seqlen, calib_samples)
    log(f"quantize: {ids.shape[0]} calibration samples x {ids.shape[1]} tokens from "
        f"{calib or calibration.DEFAULT_CORPUS}")
    store_dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float32")
    scale_dtype = torch.float16  # AWQ checkpoints keep their scales in float16 (LMDeploy loads them so)
    tuning = None
    if tune_steps:
        tune_ids = calibration.tuning_samples(tokenizer, calib, calib_seqlen, calib_samples)
        tuning = (tune_ids,) + distil.teacher_targets(model, tune_ids)  # the float model's, before any change
        log(f"quantize: {tune_ids.shape[0]} tuning samples x {tune_ids.shape[1]} tokens; the float model's "
            f"next-token distributions kept for the tuning of the scales and norms")
    hidden, kwargs = walk.first_layer_inputs(model, ids)
    num_kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    tensors, ranges, report, to_tune = {}, [], [], {}
    layers = model.model.layers
    with torch.no_grad():  # nothing below needs gradients; an autograd graph would keep float weights alive
        for i, layer in enumerate(layers):
            t0 = time.perf_counter()
            source.widen_layer(layer)
            record = walk.recorded(layer) if (method != "rtn" or kv_int8) else ()
            out, seen = walk.run_layer(layer, hidden, kwargs, record)
            if kv_int8:
                ranges.append(kv_scales.head_ranges(seen["self_attn.k_proj:out"], seen["self_attn.v_proj:out"],
                                                    kwargs, num_kv_heads))
            if method == "awq":
                groups = awq.scale_layer(layer, seen, group_size, scale_dtype)
                detail = "; ".join(f"{'+'.join(n.split('.')[-1] for n in names)} "
                                   f"alpha={'rtn' if a < 0 else f'{a:.2f}'} err rtn {r:.2e} awq {e:.2e}"
                                   for names, a, r, e in groups)
            elif method == "smooth_quant":
                groups = smooth_quant.smooth_layer(layer, seen)
                detail = "; ".join(f"{'+'.join(n.split('.')[-1] for n in names)} max|x| {b:.1f}->{a:.1f}"
                                   for names, b, a in groups)
            else:
                detail = "round to nearest"
            del seen
            if method != "rtn":
                # the next layer sees this layer as scaled; the clipping search sees the scaled inputs
                clipping = method == "awq" and clip
                out, seen = walk.run_layer(layer, hidden, kwargs, walk.LINEARS if clipping else ())
                if clipping:
                    clipped = awq_clip.clip_layer(layer, seen, group_size, scale_dtype)
                    detail += "; clip " + ", ".join(f"{n.split('.')[-1]} {b:.2e}->{a:.2e} (r {r:.2f})"
                                                    for n, b, a, r in clipped)
                del seen
            for name in walk.linears(layer):
                linear = layer.get_submodule(name)
                weight = linear.weight.detach()
                if method == "smooth_quant":
                    packed = smooth_quant.int8_tensors(weight)
                else:
                    codes = awq.quant_params(weight, group_size, scale_dtype)
                    packed = pack.awq_packed(*codes, scale_dtype)
                    if tuning is not None:
                        to_tune[f"model.layers.{i}.{name}"] = codes
                for key, value in packed.items():
                    tensors[_tensor_name(i, name, key)] = value
                if linear.bias is not None:
                    tensors[_tensor_name(i, name, "bias")] = linear.bias.detach().to(store_dtype)
            if tuning is None:
                source.release_linears(layer, walk.linears(layer))
            hidden = out
            line = f"quantize: layer {i + 1}/{len(layers)} {method} {time.perf_counter() - t0:.1f} s: {detail}"
            report.append(line)
            log(line)
    tuned = None
    if tuning is not None:
        t0 = time.perf_counter()
        scales, *tuned = distil.tune(model, to_tune, scale_dtype, *tuning, steps=tune_steps, log=log)
        for path, scale in scales.items():
            tensors[path + ".scales"] = scale.T.contiguous()
        log(f"quantize: tuned the scales and norms in {time.perf_counter() - t0:.1f} s: KL to the float model on "
            f"the tuning samples {tuned[0]:.4f} -> {tuned[1]:.4f}"
            + ("" if tuned[1] < tuned[0] else " (no gain: AWQ's values kept)"))
        del to_tune
    with torch.no_grad():  # the int8 LM head's smoothing reads these (head_stats.py)
        head_input_absmax = head_stats.absmax(model.model.norm(hidden))
    del hidden
    log(f"quantize: the LM head's input ranges recorded for the int8 head's smoothing ({head_stats.FILE_NAME}; "
        f"max |x| per channel {head_input_absmax.min():.3g} .. {head_input_absmax.max():.3g})")
    quantized = {f"model.layers.{i}.{name}." for i, layer in enumerate(layers) for name in walk.linears(layer)}
    for name, value in model.state_dict().items():
        if name.rsplit(".", 1)[0] + "." in quantized:
            continue
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        tensors[name] = value.detach().to(store_dtype)
    out_config = dict(config)
    out_config["quantization_config"] = writer.quantization_config(method, group_size)
    extra = {writer.STAMP_FILE: lambda path: path.write_text(
        json.dumps(writer.stamp(method, group_size, clip, tuple(ids.shape), tune_steps,
                                tuple(tuning[0].shape) if tuning else None, tuned), sort_keys=True) + "\n")}
    extra[head_stats.FILE_NAME] = lambda path: head_stats.save(path, head_input_absmax)
    if kv_int8:
        extra[kv_scales.FILE_NAME] = lambda path: kv_scales.save(path, ranges)
    writer.write(src, dst, out_config, tensors, extra)
    seconds = time.perf_counter() - start
    log(f"quantize: wrote {dst} in {seconds:.1f} s")
    return {"layers": report, "seconds": seconds}


def main(args: argparse.Namespace) -> int:
    from dlinfer.quantize.source import QuantizeInputError

    try:
        quantize(args.src, args.dst, args.method, args.group_size, args.calib, args.kv_int8,
                 args.calib_seqlen, args.calib_samples, clip=not args.no_clip,
                 tune_steps=0 if args.no_tune else args.tune_steps)
    except QuantizeInputError as exc:
        print(f"error: {exc}")
        return 2
    return 0
