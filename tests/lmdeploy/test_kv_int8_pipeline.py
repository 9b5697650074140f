"""quant_policy=8 on device_type="cpu": the int8 KV cache end to end.

A tiny Llama and a tiny Qwen2 run through `lmdeploy.pipeline` with quant_policy=8 and the model
folder's `kv_int8_scales.safetensors`, written here from a calibration this test computes itself
(per layer and KV head, the min / max of K after rope and of V over calibration prompts, run
through HF transformers; asymmetric: scale = (max - min) / 254, zero = -(max + min) / 2 / scale).
The reference is HF transformers in float32 with the same fake quantisation: an attention
function that replaces K (after rope) and V by (clamp(round(x / scale + zero)) - zero) * scale
before attending, for every position, the new token's included, in every step that has history
(decode). A prefill without history attends to the exact K/V, as LMDeploy does: its
`prefill_attention` takes the new tokens' K/V as computed, not read back from the int8 cache
(the cache is written, quantised, for the steps after). Greedy tokens must be equal.

Also: the cache LMDeploy allocates is 1-byte (uint8, read as int8) and its bytes are reported;
a missing scales file and quant_policy=4 are refused by name.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from support.engine_helpers import HFReference, assert_matches_hf, cpu_pipeline, greedy_generate

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
PROMPTS = (
    "Quick red river",
    "The model reads a prompt token by token and the engine keeps every key and value in the cache",
)
CALIBRATION = (
    "A small blue window in the dark forest opens on the ocean and the bright city mountain",
    "One two three four five six seven eight nine ten hundred thousand the first expert routes",
) + PROMPTS


def _fake_quant(x, scale, zero):
    """x [B, Hkv, L, D]; scale / zero [Hkv] -> the values an int8 cache gives back (float64 math
    rounded to float32 at each step, as dlinfer/ops/kv_quant.py specifies)."""
    s, z = scale.view(1, -1, 1, 1), zero.view(1, -1, 1, 1)
    y = (x.float() / s) + z
    q = torch.round(y).clamp(-128, 127)
    return ((q - z) * s).to(x.dtype)


def _attention(mode, stats, scales):
    """An HF attention function: "calibrate" records per-layer min / max of K and V, "quant"
    fake-quantises them with `scales`; both then run HF's sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if mode == "calibrate":
            for name, x in (("k", key), ("v", value)):
                lo, hi = x.amin(dim=(0, 2, 3)), x.amax(dim=(0, 2, 3))
                old = stats.get((layer, name))
                stats[(layer, name)] = ((lo, hi) if old is None
                                        else (torch.minimum(old[0], lo), torch.maximum(old[1], hi)))
        elif key.shape[2] > query.shape[2]:  # a step with history: every position read back from the cache
            key = _fake_quant(key, scales["k_scale"][layer], scales["k_zero"][layer])
            value = _fake_quant(value, scales["v_scale"][layer], scales["v_zero"][layer])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attend


def _calibrate(model_dir):
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    stats = {}
    AttentionInterface.register("dlinfer_test_calibrate", _attention("calibrate", stats, None))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="dlinfer_test_calibrate").eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.inference_mode():
        for text in CALIBRATION:
            model(torch.tensor([tok.encode(text)]))
    layers = model.config.num_hidden_layers
    out = {}
    for name in ("k", "v"):
        lo = torch.stack([stats[(i, name)][0] for i in range(layers)])
        hi = torch.stack([stats[(i, name)][1] for i in range(layers)])
        scale = ((hi - lo) / 254).clamp(min=1e-6)
        out[f"{name}_scale"] = scale.float().contiguous()
        out[f"{name}_zero"] = (-(hi + lo) / 2 / scale).float().contiguous()
    return out


def _quantised_folder(tmp_path, model_dir):
    """A copy of the tiny model's folder with its kv_int8_scales.safetensors; the scales."""
    from safetensors.torch import save_file

    folder = tmp_path / f"{model_dir.name}-kv-int8"
    shutil.copytree(model_dir, folder)
    scales = _calibrate(model_dir)
    save_file(scales, str(folder / "kv_int8_scales.safetensors"), metadata={"format": "dlinfer-kv-int8-v1"})
    return folder, scales


class _FakeQuantReference(HFReference):
    def __init__(self, model_dir, scales):
        from transformers import AttentionInterface, AutoModelForCausalLM

        AttentionInterface.register("dlinfer_test_int8", _attention("quant", None, scales))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="dlinfer_test_int8").eval()
        self._memo = {}


@pytest.mark.parametrize("name,eager", [("llama", True), ("qwen2", True), ("llama", False)])
def test_quant_policy_8_matches_hf_with_fake_quantised_kv(name, eager, model_dir, tmp_path):
    """eager_mode=False too: the compiled decode steps read the per-layer scales (graph inputs)."""
    folder, scales = _quantised_folder(tmp_path, model_dir(name))
    graph = {} if eager else dict(eager_mode=False, max_batch_size=4)
    with cpu_pipeline(folder, quant_policy=8, **graph) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
        agent = pipe.async_engine.engine.executor.model_agent
        if not eager:  # every decode step ran a compiled graph, one compile per bucket (1, 2, 4)
            runner = agent.patched_model
            assert runner.graph_steps >= NEW_TOKENS - 1 and 0 < runner.compiles <= 3, (runner.graph_steps,
                                                                                      runner.compiles)
        caches = agent.cache_engine.gpu_cache
        assert caches[0][0].element_size() == 1 and caches[0][1].element_size() == 1, caches[0][0].dtype
        print(f"{name}: quant_policy=8 KV cache tensors per layer: "
              f"{[(str(t.dtype), list(t.shape)) for t in caches[0]]}")
    assert_matches_hf(results, _FakeQuantReference(folder, scales), NEW_TOKENS)


def test_quant_policy_8_without_scales_file_is_refused(model_dir, tmp_path):
    folder = tmp_path / "no-scales"
    shutil.copytree(model_dir("llama"), folder)
    with pytest.raises(Exception, match="kv_int8_scales.safetensors does not exist.*--kv-int8"):
        with cpu_pipeline(folder, quant_policy=8):
            pass


def test_quant_policy_4_is_refused_by_name():
    from lmdeploy import PytorchEngineConfig

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    with pytest.raises(ValueError, match="quant_policy=4 \\(4: the int4 KV cache is not implemented\\)"):
        PytorchEngineConfig(device_type="cpu", quant_policy=4)


def test_scales_file_checks(tmp_path):
    from safetensors.torch import save_file

    from dlinfer.framework.lmdeploy_ext.backend.kv_int8 import KVScalesError, read_scales

    good = {n: torch.full((2, 3), 0.1 if n.endswith("scale") else 0.0) for n in ("k_scale", "k_zero", "v_scale",
                                                                                     "v_zero")}
    save_file(good, str(tmp_path / "kv_int8_scales.safetensors"), metadata={"format": "dlinfer-kv-int8-v1"})
    assert set(read_scales(str(tmp_path), 2, 3)) == set(good)
    with pytest.raises(KVScalesError, match=r"k_scale is torch.float32 \[2, 3\], expected float32 "
                                            r"\[num_hidden_layers=4, num_key_value_heads=3\]"):
        read_scales(str(tmp_path), 4, 3)
    bad = dict(good, v_scale=torch.zeros(2, 3))
    save_file(bad, str(tmp_path / "kv_int8_scales.safetensors"), metadata={"format": "dlinfer-kv-int8-v1"})
    with pytest.raises(KVScalesError, match="v_scale must be finite and > 0"):
        read_scales(str(tmp_path), 2, 3)
    save_file(good, str(tmp_path / "kv_int8_scales.safetensors"), metadata={"format": "other"})
    with pytest.raises(KVScalesError, match="metadata format 'other'"):
        read_scales(str(tmp_path), 2, 3)
    os.remove(tmp_path / "kv_int8_scales.safetensors")
    message = "does not exist.*python -m dlinfer quantize SRC DST --method ... --kv-int8"
    with pytest.raises(KVScalesError, match=message):
        read_scales(str(tmp_path), 2, 3)
