"""`python -m dlinfer quantize` holds the source model in its own dtype and one float32 layer at a
time (dlinfer/quantize/source.py), so a bf16 model is quantised in about its bf16 size, not twice
that: what lets an 8B bf16 checkpoint (16 GB) be quantised on a 24 GB machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.tiny_models import CACHE_ROOT, _save_tokenizer, cached_folder

# Llama-shaped, 16 layers of 14.7M parameters: 469 MB in bf16, 938 MB in float32.
SPEC = dict(model_type="llama", vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=None, pad_token_id=0)


def _bf16_model():
    def build(staging):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        spec = dict(SPEC)
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(staging)
        _save_tokenizer(staging)

    return cached_folder(CACHE_ROOT / "quantize_memory" / "llama-16x1024-bf16", build)


_SCRIPT = """
import json, sys, threading, time
import torch, transformers, safetensors.torch
from transformers import LlamaForCausalLM
from dlinfer.__main__ import main

def anonymous():  # resident anonymous memory: the mapped checkpoint's pages are file-backed, reclaimable
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

peak, done = [anonymous()], threading.Event()
def sample():
    while not done.wait(0.002):
        peak[0] = max(peak[0], anonymous())
before = anonymous()
sampler = threading.Thread(target=sample)
sampler.start()
code = main(["quantize", sys.argv[1], sys.argv[2], "--method", "rtn", "--calib-samples", "4"])
done.set()
sampler.join()
print(json.dumps({"code": code, "before": before, "peak": peak[0]}))
"""


@pytest.mark.slow
def test_a_bf16_model_is_quantised_in_about_its_own_size(tmp_path):
    src = _bf16_model()
    weights = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(src), str(tmp_path / "dst")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rss["code"] == 0 and "in bfloat16, each layer widened to float32" in proc.stdout
    grew = rss["peak"] - rss["before"]
    # A float32 load alone grows by 2 x weights (938 MiB). Layer by layer it is the 4-bit tensors
    # kept (weights / 4), one layer in float32 and its quantisation's temporaries (measured: 441 MiB).
    print(f"anonymous memory grew {grew / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of bf16 weights")
    assert grew < 0.6 * (2 * weights), (grew / 2**20, weights / 2**20)
