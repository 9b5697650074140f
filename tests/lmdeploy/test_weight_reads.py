"""patches/weight_reads.py: a CPU engine reads its safetensors shards tensor by tensor (no mapped
file), and gives HF transformers' greedy tokens with them; other devices keep LMDeploy's reader."""

from __future__ import annotations

from support.engine_helpers import HFReference, assert_matches_hf, cpu_pipeline, greedy_generate
from support.tiny_models import tiny_model

from dlinfer.framework.lmdeploy_ext.patches import weight_reads
from dlinfer.utils import safetensors_reader

NEW_TOKENS = 8
PROMPTS = ("A small blue window in the dark forest", "The engine keeps every key and value in the cache")


def test_a_cpu_engine_reads_each_shard_with_plain_reads(monkeypatch):
    read = []

    def spy(path, prefix=None):
        read.append(path)
        yield from safetensors_reader.read_tensors(path, prefix)

    monkeypatch.setattr(weight_reads, "read_tensors", spy)
    folder = tiny_model("llama")
    with cpu_pipeline(folder) as pipe:
        results = greedy_generate(pipe, PROMPTS, NEW_TOKENS)
    assert sorted(read) == sorted(str(p) for p in folder.glob("*.safetensors"))
    assert_matches_hf(results, HFReference(folder), NEW_TOKENS)


def test_the_plain_reader_only_runs_inside_a_cpu_load(tmp_path):
    """Outside an agent's load onto the CPU (a GPU agent's, any other caller) LMDeploy's own
    iterator runs."""
    import torch
    from lmdeploy.pytorch.weight_loader.model_weight_loader import ModelWeightLoader
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 3)}, str(tmp_path / "model.safetensors"))
    loader = ModelWeightLoader(str(tmp_path))
    it = loader._get_weights_iterator(str(tmp_path / "model.safetensors"))
    assert not hasattr(it, "gi_code") or it.gi_code is not safetensors_reader.read_tensors.__code__
    token = weight_reads._plain_reads.set(True)
    try:
        it = loader._get_weights_iterator(str(tmp_path / "model.safetensors"))
        assert it.gi_code is safetensors_reader.read_tensors.__code__
        assert [(n, t.tolist()) for n, t in it] == [("w", [[1.0] * 3] * 2)]
    finally:
        weight_reads._plain_reads.reset(token)
