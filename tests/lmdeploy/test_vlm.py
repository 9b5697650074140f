"""Vision-language models through `lmdeploy.pipeline` on device_type="cpu": greedy tokens of a batch
of (prompt, PIL image) requests equal HF transformers' (float32) on identical input.

Identical input: for each request the pipeline's own preprocessing (chat template, image tokens,
pixel values: patches/vl_preprocess.py, no torchvision) is recorded where LMDeploy hands it to the
engine (`ImageEncoder.wrap_for_pytorch`); HF `generate` gets exactly those input ids and pixel
values. The test also checks that
- HF transformers' image processor, called on the same PIL image, makes the same pixel values;
- the image decides HF's tokens (other pixel values give other tokens), so equal tokens say
  something about the vision tower and the image-token placement, not only the language model;
- the requests differ in prompt length and image size (number of image tokens).

Per model (tiny_vlms.py: InternVL (HF-native), Qwen2-VL, Qwen2.5-VL):
- eager, with chunked prefill (`max_prefill_token_num=32`, shorter than each prompt);
- graph mode (`eager_mode=False`): decode steps compiled by dlinfer's backend, buckets 1 and 2, one
  compile per bucket (prefill, hence the vision tower, always runs eagerly);
- bfloat16 runs (every token produced; not compared with HF).
Qwen2-VL's and Qwen2.5-VL's vision attention is non-causal: it runs through dlinfer's ops
(`backend/bidirectional_attention.py`), checked here to be built and called, and checked on its own
against a per-segment softmax. Fast tests (no engine) cover the model check's VLM rules.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from support.engine_helpers import MIN_TOP2_MARGIN, OpCalls, cpu_pipeline
from support.tiny_vlms import SPECS, tiny_internvl_chat, tiny_vlm

from dlinfer.framework.lmdeploy_ext import UnsupportedModelError, devices
from dlinfer.framework.lmdeploy_ext.backend import model_support
from dlinfer.framework.lmdeploy_ext.backend.bidirectional_attention import (
    BLOCK_SIZE,
    DlinferBidirectionalAttentionImpl,
    build_bidirectional_attention,
)
from dlinfer.framework.lmdeploy_ext.backend.model_support import SUPPORTED_ARCHITECTURES, check_model

NEW_TOKENS = 12
GRAPH_NEW_TOKENS = 8
MODELS = ("internvl", "qwen2_vl", "qwen2_5_vl")  # internvl_llama: the reference of the remote-code InternLM2 one


def _image(width: int, height: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# Two requests of different prompt lengths and image sizes: a 112x56 image (InternVL: two 56x56
# tiles and a thumbnail; Qwen2-VL: 4x8 patches) and a 56x84 one (one tile; 6x4 patches).
REQUESTS = (
    ("Describe the red river", (112, 56, 1)),
    ("One two three four five six seven eight nine ten: what is in the window of this city", (56, 84, 2)),
)


def _requests():
    return [(text, _image(*size)) for text, size in REQUESTS]


class _Recorder:
    """What the pipeline handed to the engine for each request (prompt, input ids, multimodal)."""

    def __init__(self, monkeypatch):
        from lmdeploy.vl.engine import ImageEncoder

        self.records: list[dict] = []
        original = ImageEncoder.wrap_for_pytorch

        async def wrap_for_pytorch(encoder, *args, **kwargs):
            result = await original(encoder, *args, **kwargs)
            # the engine later pops 'multimodal' from this dict: keep our own copy
            self.records.append(dict(prompt=result["prompt"], input_ids=list(result["input_ids"]),
                                     multimodal=[dict(item) for item in result["multimodal"]]))
            return result

        monkeypatch.setattr(ImageEncoder, "wrap_for_pytorch", wrap_for_pytorch)

    def of(self, text: str) -> dict:
        found = [r for r in self.records if text in r["prompt"]]
        assert len(found) == 1, (text, [r["prompt"] for r in self.records])
        return found[0]


def _run(pipe, recorder: _Recorder, new_tokens: int) -> list[tuple[dict, list[int], list[int]]]:
    """(recorded input, LMDeploy's tokens, banned ids) per request, all requests in one batch."""
    from lmdeploy import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, ignore_eos=True)
    outputs = pipe(_requests(), gen_config=gen)
    results = []
    for (text, _), out in zip(REQUESTS, outputs):
        record = recorder.of(text)
        assert out.input_token_len == len(record["input_ids"])
        assert out.finish_reason == "length" and len(out.token_ids) == new_tokens
        resolved = pipe.async_engine._determine_gen_config(record["input_ids"], gen)
        banned = sorted(set(resolved.stop_token_ids or []) | set(resolved.bad_token_ids or []))
        results.append((record, list(out.token_ids), banned))
    return results


class _HFVLM:
    """HF transformers greedy generation of one tiny VLM in float32."""

    def __init__(self, name: str, path: Path):
        import transformers

        self.name, self.path = name, path
        self.model = getattr(transformers, SPECS[name]["model"]).from_pretrained(path, dtype=torch.float32).eval()
        self._memo: dict = {}

    def pixel_kwargs(self, multimodal: list[dict]) -> dict:
        kwargs = dict(pixel_values=torch.cat([item["pixel_values"] for item in multimodal]))
        if not self.name.startswith("internvl"):
            kwargs["image_grid_thw"] = torch.cat([item["image_grid_thw"] for item in multimodal])
        return kwargs

    def greedy(self, input_ids, pixel_kwargs: dict, new_tokens: int, banned) -> tuple[list[int], float]:
        key = (tuple(input_ids), new_tokens, tuple(banned), float(pixel_kwargs["pixel_values"].sum()))
        if key not in self._memo:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([list(input_ids)]), attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
                    do_sample=False, max_new_tokens=new_tokens, bad_words_ids=[[i] for i in banned] or None,
                    output_scores=True, return_dict_in_generate=True, pad_token_id=0, **pixel_kwargs)
            top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
            self._memo[key] = (out.sequences[0, len(input_ids):].tolist(), float((top2[:, 0] - top2[:, 1]).min()))
        return self._memo[key]

    def image_processor_pixels(self, image) -> torch.Tensor:
        """Pixel values of HF transformers' own image processor for `image`."""
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(self.path)
        if self.name == "internvl":
            return processor(images=[image], crop_to_patches=True, return_tensors="pt")["pixel_values"]
        return processor(images=[image], return_tensors="pt")["pixel_values"]


@pytest.fixture(scope="module")
def hf_vlm():
    cache: dict[str, _HFVLM] = {}

    def get(name: str) -> _HFVLM:
        if name not in cache:
            cache[name] = _HFVLM(name, tiny_vlm(name))
        return cache[name]

    return get


def _assert_matches_hf(results, reference: _HFVLM, new_tokens: int) -> None:
    lengths, image_tokens = set(), set()
    for i, (record, tokens, banned) in enumerate(results):
        expected, margin = reference.greedy(record["input_ids"], reference.pixel_kwargs(record["multimodal"]),
                                            new_tokens, banned)
        assert margin > MIN_TOP2_MARGIN, f"request {i}: HF's reference path has a near tie ({margin:.2e})"
        assert len(set(expected)) > 1, f"request {i}: HF's reference repeats one token"
        assert tokens == expected, (f"request {i} ({len(record['input_ids'])} tokens): LMDeploy on CPU differs "
                                    f"from HF\n  lmdeploy: {tokens}\n  hf:       {expected}")
        lengths.add(len(record["input_ids"]))
        image_tokens.add(sum(int(item["image_tokens"]) for item in record["multimodal"]))
    assert len(lengths) == len(results) and len(image_tokens) == len(results), (lengths, image_tokens)


_ARCH = {name: spec["model"] for name, spec in SPECS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf(name, hf_vlm, monkeypatch):
    """eager_mode=True, chunked prefill: tokens equal HF's; HF's image processor gives the same
    pixel values; the image decides the tokens; non-causal vision attention runs on dlinfer's ops."""
    recorder = _Recorder(monkeypatch)
    paged_prefill = OpCalls(monkeypatch, "paged_prefill_attention")
    calls = []
    original_forward = DlinferBidirectionalAttentionImpl.forward
    monkeypatch.setattr(DlinferBidirectionalAttentionImpl, "forward",
                        lambda self, *a, **k: calls.append(1) or original_forward(self, *a, **k))
    with cpu_pipeline(tiny_vlm(name), max_prefill_token_num=32, max_batch_size=2) as pipe:
        engine = pipe.async_engine.engine
        assert engine.model_config.hf_config.architectures == [_ARCH[name]]
        model = engine.executor.model_agent.patched_model.get_model()
        results = _run(pipe, recorder, NEW_TOKENS)
    reference = hf_vlm(name)
    _assert_matches_hf(results, reference, NEW_TOKENS)
    assert max(len(record["input_ids"]) for record, _, _ in results) > 32
    assert paged_prefill.count > 0  # later chunks attend to the earlier ones through the cache

    # LMDeploy's preprocessing = HF's image processor on the same image
    for (text, image), (record, _, _) in zip(_requests(), results):
        torch.testing.assert_close(torch.cat([item["pixel_values"] for item in record["multimodal"]]),
                                   reference.image_processor_pixels(image), rtol=0, atol=0)
    # The image decides HF's tokens: other pixel values, other tokens.
    record, tokens, banned = results[0]
    other = reference.pixel_kwargs(record["multimodal"])
    other["pixel_values"] = -other["pixel_values"]
    assert reference.greedy(record["input_ids"], other, NEW_TOKENS, banned)[0] != tokens

    if name == "internvl":  # LMDeploy's InternViT attention is torch's SDPA, not a dlinfer layer
        assert not calls
    else:
        assert type(model.visual.blocks[0].attn.attention.impl) is DlinferBidirectionalAttentionImpl
        assert len(calls) >= len(model.visual.blocks)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_graph_mode_matches_hf(name, hf_vlm, monkeypatch):
    """eager_mode=False: decode steps (with Qwen2-VL's mrope positions) run graphs compiled by
    dlinfer's backend, buckets 1 and 2, one compile per bucket."""
    recorder = _Recorder(monkeypatch)
    with cpu_pipeline(tiny_vlm(name), eager_mode=False, max_batch_size=2) as pipe:
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        results = _run(pipe, recorder, GRAPH_NEW_TOKENS)
    assert type(runner).__name__ == "DlinferGraphRunner" and runner.buckets == [1, 2]
    assert runner.graph_steps >= GRAPH_NEW_TOKENS - 1
    assert runner.compiles == 1  # one trace that every bucket shares
    _assert_matches_hf(results, hf_vlm(name), GRAPH_NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_runs(name, monkeypatch):
    recorder = _Recorder(monkeypatch)
    with cpu_pipeline(tiny_vlm(name), dtype="bfloat16", max_batch_size=2) as pipe:
        assert pipe.async_engine.engine.model_config.dtype == torch.bfloat16
        _run(pipe, recorder, 4)  # every token produced (checked in _run)


@pytest.mark.slow
def test_explicit_float32_runs(monkeypatch):
    """dtype="float32" (LMDeploy's VL engine maps float16/bfloat16 only): pixel values in float32."""
    recorder = _Recorder(monkeypatch)
    with cpu_pipeline(tiny_vlm("internvl"), dtype="float32", max_batch_size=2) as pipe:
        results = _run(pipe, recorder, 2)
    assert all(item["pixel_values"].dtype == torch.float32 for record, _, _ in results for item in record["multimodal"])


@pytest.mark.slow
@pytest.mark.parametrize("config,arch,message", [
    (dict(model_type="qwen3_vl"), "Qwen3VLForConditionalGeneration", "; supported: "),
    (dict(model_type="cogvlm", vision_config=dict(image_size=224, patch_size=14, num_positions=257)),
     "CogVLMForCausalLM", "(its tokens cannot be compared with HF transformers offline"),
])
def test_unsupported_vlm_is_refused_by_name_before_its_preprocessor(config, arch, message, tmp_path):
    """Qwen3-VL's and CogVLM's LMDeploy preprocessors need torchvision: the refusal comes first."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    with pytest.raises(UnsupportedModelError, match=re.escape(f"cannot run architecture {arch!r}")) as info:
        with cpu_pipeline(tmp_path):
            pass
    assert message in str(info.value) and str(info.value).endswith(f"; supported: {supported}.")


# -- remote-code InternVL (InternVLChatModel, InternVL 1.5 / 2) -------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("llm,reference_name", [("qwen2", "internvl"), ("internlm2", "internvl_llama")])
def test_remote_code_internvl_matches_the_hf_native_model(llm, reference_name, hf_vlm, monkeypatch):
    """A remote-code InternVL checkpoint written from the tiny HF-native one's weights
    (tiny_vlms.tiny_internvl_chat: InternViT + Qwen2, or InternLM2 from a Llama-based one; the
    checkpoint's own config module) runs
    through LMDeploy's InternVLChatModel with its dynamic-tile preprocessing built without
    torchvision: eager with chunked prefill, then graph mode, each equal to the HF-native model
    fed the same input ids and pixel values; bfloat16 runs. Each tile's pixels equal HF's image
    processor's for that tile."""
    from transformers import AutoImageProcessor

    from dlinfer.framework.lmdeploy_ext.patches.vl_preprocess import TileTransform

    reference = hf_vlm(reference_name)
    checkpoint = tiny_internvl_chat(llm)
    recorder = _Recorder(monkeypatch)
    with cpu_pipeline(checkpoint, trust_remote_code=True, max_prefill_token_num=32,
                      max_batch_size=2) as pipe:
        assert pipe.async_engine.engine.model_config.hf_config.architectures == ["InternVLChatModel"]
        results = _run(pipe, recorder, NEW_TOKENS)
    _assert_matches_hf(results, reference, NEW_TOKENS)
    assert max(len(record["input_ids"]) for record, _, _ in results) > 32
    assert {int(item["pixel_values"].shape[0]) for record, _, _ in results for item in record["multimodal"]} == {3, 7}

    graph = _Recorder(monkeypatch)
    with cpu_pipeline(checkpoint, trust_remote_code=True, eager_mode=False, max_batch_size=2) as pipe:
        runner = pipe.async_engine.engine.executor.model_agent.patched_model
        graph_results = _run(pipe, graph, GRAPH_NEW_TOKENS)
    assert type(runner).__name__ == "DlinferGraphRunner" and runner.graph_steps >= GRAPH_NEW_TOKENS - 1
    _assert_matches_hf(graph_results, reference, GRAPH_NEW_TOKENS)

    with cpu_pipeline(checkpoint, trust_remote_code=True, dtype="bfloat16", max_batch_size=2) as pipe:
        _run(pipe, _Recorder(monkeypatch), 4)

    # one tile: the stand-in for torchvision's transform = HF's image processor without cropping,
    # with InternVL 1.5 / 2's ImageNet mean and std
    processor = AutoImageProcessor.from_pretrained(tiny_vlm("internvl"))
    for size, seed in ((56, 3), (80, 4), (33, 5)):
        tile = _image(size, size, seed)
        expected = processor(images=[tile], crop_to_patches=False, image_mean=TileTransform.MEAN,
                             image_std=TileTransform.STD, return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(TileTransform(56)(tile), expected, rtol=0, atol=1e-6)


def _internvl_chat_config(llm_arch="Qwen2ForCausalLM", **top):
    from types import SimpleNamespace

    llm = SimpleNamespace(architectures=[llm_arch], max_position_embeddings=1024, tie_word_embeddings=False)
    fields = {**dict(dynamic_image_size=True, ps_version="v2", select_layer=-1, tie_word_embeddings=False), **top}
    return SimpleNamespace(hf_config=SimpleNamespace(architectures=["InternVLChatModel"], llm_config=llm, **fields),
                           sliding_window=-1)


@pytest.mark.parametrize("llm_arch,top,message", [
    ("Phi3ForCausalLM", {}, "with a Phi3ForCausalLM language model: compared with HF transformers are the Qwen2"),
    ("Qwen2ForCausalLM", {"dynamic_image_size": False}, "without dynamic_image_size"),
    ("Qwen2ForCausalLM", {"ps_version": "v1"}, "ps_version='v1'"),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": True}, "LMDeploy ties the LM head by the top-level value"),
])
def test_remote_code_internvl_other_than_tested_is_refused(llm_arch, top, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        check_model(_internvl_chat_config(llm_arch, **top), devices.CPU)
    check_model(_internvl_chat_config(), devices.CPU)


# -- the non-causal attention on its own -----------------------------------------------------------

def _segment_softmax(q, k, v, q_start, q_len, k_start, k_len, scale):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    for qs, qn, ks, kn in zip(q_start, q_len, k_start, k_len):
        if qn == 0 or kn == 0:
            continue
        qq = q[qs:qs + qn].transpose(0, 1).double()
        kk = k[ks:ks + kn].repeat_interleave(group, 1).transpose(0, 1).double()
        vv = v[ks:ks + kn].repeat_interleave(group, 1).transpose(0, 1).double()
        weights = torch.softmax(qq @ kk.transpose(1, 2) * scale, dim=-1)
        out[qs:qs + qn] = (weights @ vv).transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("lengths,hq,hkv,dv", [
    ([7], 4, 4, 16),                              # one image
    ([BLOCK_SIZE + 5, 0, 3, 2 * BLOCK_SIZE], 4, 2, 16),  # several, an empty one (Qwen2.5-VL windows), GQA
    ([5, 9], 2, 1, 8),                            # Dv != D
])
def test_bidirectional_attention_is_a_softmax_over_each_segment(lengths, hq, hkv, dv):
    torch.manual_seed(0)
    total, d = sum(lengths), 16
    q, k = torch.randn(total, hq, d), torch.randn(total, hkv, d)
    v = torch.randn(total, hkv, dv)
    lens = torch.tensor(lengths, dtype=torch.int32)
    starts = torch.cumsum(lens, 0, dtype=torch.int32) - lens
    impl = DlinferBidirectionalAttentionImpl(hq, d, None, hkv, dv)
    out = impl.forward(q, k, v, starts, lens, starts, lens)
    expected = _segment_softmax(q, k, v, starts.tolist(), lengths, starts.tolist(), lengths, d ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # not causal: the first row of a segment sees its last key
    assert not torch.allclose(out[0], v[0].repeat_interleave(hq // hkv, 0))


def test_only_non_causal_attention_is_rebuilt():
    from lmdeploy.pytorch.backends.dlinfer.flash_attention import DlinferFlashAttentionImpl
    from lmdeploy.pytorch.backends.flash_attention import FlashAttentionBuildSpec

    from dlinfer.framework.lmdeploy_ext.backend.op_backend import CpuOpsBackend

    spec = dict(num_heads=4, head_dim=16, scale=None, num_kv_heads=4, v_head_dim=16, sliding_window=None,
                logit_softcapping=0.0)
    non_causal = CpuOpsBackend.build_op(FlashAttentionBuildSpec(causal=False, **spec))
    assert type(non_causal) is DlinferBidirectionalAttentionImpl
    # causal attention keeps LMDeploy's own dlinfer layer
    assert type(CpuOpsBackend.build_op(FlashAttentionBuildSpec(causal=True, **spec))) is DlinferFlashAttentionImpl
    with pytest.raises(NotImplementedError, match="sliding_window=16"):
        build_bidirectional_attention(FlashAttentionBuildSpec(causal=False, **{**spec, "sliding_window": 16}))


# -- the model check's VLM rules (no engine) ---------------------------------------------------------

def _vlm_config(arch, text=None, **top):
    from types import SimpleNamespace

    text_config = SimpleNamespace(max_position_embeddings=1024, **(text or {}))
    hf_config = SimpleNamespace(architectures=[arch], text_config=text_config, **top)
    return SimpleNamespace(hf_config=hf_config, sliding_window=-1)


_MROPE = {"rope_scaling": {"type": "default", "rope_type": "default", "mrope_section": [16, 24, 24]}}


@pytest.mark.parametrize("arch,text", [
    ("InternVLForConditionalGeneration", {}),
    ("Qwen2VLForConditionalGeneration", _MROPE),
    ("Qwen2_5_VLForConditionalGeneration", _MROPE),
    ("Qwen2VLForConditionalGeneration", {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}),
])
def test_vlms_the_tests_prove_pass(arch, text):
    check_model(_vlm_config(arch, text), devices.CPU)


@pytest.mark.parametrize("arch,text,top,message", [
    # the language model's rope, in text_config, is checked
    ("InternVLForConditionalGeneration", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, {},
     "rope_type='dynamic' (InternVLForConditionalGeneration)"),
    ("InternVLForConditionalGeneration", _MROPE, {}, "cannot run multimodal (mrope)"),
    ("Qwen2VLForConditionalGeneration", {"rope_scaling": {**_MROPE["rope_scaling"], "mrope_interleaved": True}}, {},
     "cannot run multimodal rope with rope_type='default', mrope_interleaved=True"),
    ("Qwen2_5_VLForConditionalGeneration", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                             "mrope_section": [16, 24, 24]}}, {},
     "cannot run multimodal rope with rope_type='yarn'"),
    ("Qwen2VLForConditionalGeneration", {**_MROPE, "quantization_config": {"quant_method": "awq"}}, {},
     "cannot run quant_method='awq' (Qwen2VLForConditionalGeneration): not compared with HF transformers"),
    ("InternVLForConditionalGeneration", {}, {"quantization_config": {"quant_method": "gptq"}},
     "quant_method='gptq'"),
])
def test_vlm_language_model_features_are_refused(arch, text, top, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        check_model(_vlm_config(arch, text, **top), devices.CPU)


@pytest.mark.parametrize("arch", sorted(model_support.REFUSED_ARCHITECTURES))
def test_refused_vlms_name_their_reason_and_what_is_supported(arch):
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    expected = (f"device_type='cpu' cannot run architecture {arch!r} ({model_support.REFUSED_ARCHITECTURES[arch]}); "
                f"supported: {supported}.")
    with pytest.raises(UnsupportedModelError, match=re.escape(expected)):
        check_model(_vlm_config(arch), devices.CPU)
    assert set(model_support.VISION_LANGUAGE_ARCHITECTURES) <= SUPPORTED_ARCHITECTURES
    assert not set(model_support.REFUSED_ARCHITECTURES) & SUPPORTED_ARCHITECTURES
