"""The tuning that ends AWQ (dlinfer/quantize/distil.py): the coarsened KL against a float64
reference, what the tuning may change (group scales and norms) and that it lowers its objective
or undoes itself; through the command: the stored codes and zero points are AWQ's bit for bit
and only scales and norms differ from a `--no-tune` run."""

from __future__ import annotations

import json

import pytest
import torch
from support.tiny_models import tiny_model  # noqa: E402

from dlinfer.__main__ import main  # noqa: E402
from dlinfer.quantize import awq, calib, distil, writer  # noqa: E402


def _kl64(p_logits: torch.Tensor, q_logits: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor:
    """Mean KL(p || q) in float64 over the bins {each id of `top`, the rest} (None: every token)."""
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    if top is None:
        return (p * (p.log() - q.log())).sum(-1).mean()
    rest = torch.ones_like(p, dtype=torch.bool).scatter(-1, top, False)
    pb = torch.cat([p.gather(-1, top), (p * rest).sum(-1, keepdim=True)], -1)
    qb = torch.cat([q.gather(-1, top), (q * rest).sum(-1, keepdim=True)], -1)
    return (pb * (pb.log() - qb.log())).sum(-1).mean()


@pytest.mark.parametrize("k", [1, 5, 63])
def test_coarse_kl_matches_a_float64_reference(k):
    g = torch.Generator().manual_seed(k)
    teacher, student = torch.randn(3, 7, 64, generator=g) * 3, torch.randn(3, 7, 64, generator=g) * 3
    top = teacher.topk(k, dim=-1).indices
    got = distil.kl(student, top, distil.coarse_log_probs(teacher, top))
    torch.testing.assert_close(got.double(), _kl64(teacher, student, top), rtol=1e-5, atol=1e-6)
    if k == 63:  # k = V - 1: the rest is one token, the bins are the vocabulary: the full KL
        torch.testing.assert_close(got.double(), _kl64(teacher, student, None), rtol=1e-5, atol=1e-6)
    assert distil.kl(teacher, top, distil.coarse_log_probs(teacher, top)).abs() < 1e-6  # same model: 0


def test_coarse_kl_never_exceeds_the_full_kl():
    """Merging bins can only lose information (the data-processing inequality)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        teacher, student = torch.randn(4, 64, generator=g) * 2, torch.randn(4, 64, generator=g) * 2
        top = teacher.topk(8, dim=-1).indices
        assert distil.kl(student, top, distil.coarse_log_probs(teacher, top)) <= _kl64(teacher, student, None) + 1e-6


def test_teacher_targets_are_the_float_models_coarsened_distributions():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    top, logp = distil.teacher_targets(model, ids, top_k=16, batch=2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    assert top.shape == (3, 9, 16) and logp.shape == (3, 9, 17)
    torch.testing.assert_close(top, logits.topk(16, dim=-1).indices)
    probs = logits.softmax(-1)
    expected = torch.cat([probs.gather(-1, top), 1 - probs.gather(-1, top).sum(-1, keepdim=True)], -1).log()
    torch.testing.assert_close(logp.double(), expected, rtol=1e-4, atol=1e-5)


def _quantised_tiny(name: str, group: int = 32):
    """(float teacher, student, codes): a tiny model and a copy whose decoder linears are RTN 4-bit
    (their weights set to the dequantised values), with the codes `awq.quant_params` gave."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32).eval()
    codes = {}
    with torch.no_grad():
        for path, module in student.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in path:
                codes[path] = awq.quant_params(module.weight, group, torch.float16)
                module.weight.copy_(awq.fake_quant(module.weight, group, torch.float16))
    return teacher, student, codes


def test_the_stand_in_linear_computes_the_stored_weights():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    q, zero, scale = awq.quant_params(w, 32, torch.float16)
    bias = torch.randn(24)
    module = distil.group_scaled_linear(q, zero, scale, bias)
    x = torch.randn(5, 64)
    deq = ((q.reshape(24, 2, 32) - zero[..., None]).double() * scale.double()[..., None]).reshape(24, 64)
    torch.testing.assert_close(module(x).double(), x.double() @ deq.T + bias.double(), rtol=1e-5, atol=1e-5)
    assert [name for name, _ in module.named_parameters()] == ["d"]


def test_tuning_lowers_the_kl_and_moves_only_scales_and_norms():
    teacher, student, codes = _quantised_tiny("llama")
    ids = torch.randint(0, teacher.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    top, targets = distil.teacher_targets(teacher, ids)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    modules = {path: student.get_submodule(path) for path in codes}
    awq_scales = {path: c[2].clone() for path, c in codes.items()}
    norms = distil.norm_weights(student)
    assert len(norms) == 2 * student.config.num_hidden_layers + 1  # each layer's two, the final norm
    scales, kl0, kl1 = distil.tune(student, codes, torch.float16, ids, top, targets, steps=20, lr=1e-2, batch=4)
    assert kl1 < 0.9 * kl0
    for name, value in student.state_dict().items():  # the linears' float weights are left alone
        assert torch.equal(value, before[name]) != (name in norms), name
    assert all(student.get_submodule(path) is module for path, module in modules.items())
    for path, scale in scales.items():
        assert scale.dtype == torch.float16 and scale.shape == codes[path][2].shape
    assert any(not torch.equal(scales[p].float(), awq_scales[p]) for p in codes)
    assert all(torch.equal(codes[p][2], awq_scales[p]) for p in codes)  # the caller's tensors untouched
    assert all(p.requires_grad for p in student.parameters())  # as from_pretrained left them
    assert all(p.grad is None for p in student.parameters())
    # the KL reported is the student's with the returned (float16) scales and tuned norms
    with torch.no_grad():
        for path, scale in scales.items():
            q, zero, _ = codes[path]
            g = q.shape[1] // zero.shape[1]
            w = ((q.reshape(q.shape[0], -1, g) - zero[..., None]).float() * scale.float()[..., None])
            student.get_submodule(path).weight.copy_(w.reshape(q.shape))
        got = distil.kl(student(input_ids=ids).logits, top, targets).item()
    assert got == pytest.approx(kl1, rel=1e-4)


def test_a_tuning_that_does_not_lower_the_kl_is_undone():
    teacher, student, codes = _quantised_tiny("qwen2")
    ids = torch.randint(0, teacher.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(2))
    top, targets = distil.teacher_targets(teacher, ids)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    awq_scales = {path: c[2].clone() for path, c in codes.items()}
    scales, kl0, kl1 = distil.tune(student, codes, torch.float16, ids, top, targets, steps=3, lr=10.0,
                                   batch=4)  # steps far too big
    assert kl1 == kl0
    for name, value in student.state_dict().items():
        assert torch.equal(value, before[name]), name
    for path, scale in scales.items():
        assert torch.equal(scale, awq_scales[path].to(torch.float16)) and torch.equal(codes[path][2], awq_scales[path])


def test_default_tuning_samples_are_the_calibration_corpus_then_the_tuning_text():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    shipped = calib.samples(tokenizer, None, 32, 1000)
    tuning = calib.tuning_samples(tokenizer, None, 32, 1000)
    assert tuning.shape[0] > shipped.shape[0]
    assert torch.equal(tuning[:shipped.shape[0] - 1], shipped[:-1])  # the last window may span the seam
    assert calib.tuning_samples(tokenizer, None, 32, 5).shape == (5, 32)


@pytest.fixture(scope="module")
def tuned_and_untuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    common = ["--method", "awq", "--group-size", "64", "--calib-samples", "8", "--calib-seqlen", "64"]
    src = str(tiny_model("llama"))
    assert main(["quantize", src, str(root / "tuned"), "--tune-steps", "6"] + common) == 0
    assert main(["quantize", src, str(root / "untuned"), "--no-tune"] + common) == 0
    return root / "tuned", root / "untuned"


def test_the_command_tunes_only_the_scales_and_norms(tuned_and_untuned):
    from safetensors.torch import load_file

    tuned, untuned = (load_file(str(folder / "model.safetensors")) for folder in tuned_and_untuned)
    assert tuned.keys() == untuned.keys()
    changed = {name for name in tuned if not torch.equal(tuned[name], untuned[name])}
    assert any(name.endswith(".scales") for name in changed) and any(name.endswith("norm.weight") for name in changed)
    assert all(name.endswith((".scales", "norm.weight")) for name in changed)  # codes, zeros, embeddings: AWQ's
    assert all(tuned[name].dtype == untuned[name].dtype for name in changed)
    stamps = [json.loads((folder / writer.STAMP_FILE).read_text()) for folder in tuned_and_untuned]
    assert stamps[0]["recipe"] == writer.RECIPE_TAGS["awq"] == "duo-clip-tune"
    assert stamps[0]["tune"]["steps"] == 6 and stamps[0]["tune"]["kl_after"] < stamps[0]["tune"]["kl_before"]
    assert stamps[1]["recipe"] == "duo-clip" and stamps[1]["tune"] is None


def test_tuning_progress_and_bad_steps(tmp_path, capsys):
    src = str(tiny_model("llama"))
    assert main(["quantize", src, str(tmp_path / "a"), "--method", "awq", "--group-size", "64",
                 "--calib-samples", "4", "--calib-seqlen", "32", "--tune-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tuning step 2/2" in out and "tuned the scales and norms in" in out
    assert main(["quantize", src, str(tmp_path / "b"), "--method", "awq", "--group-size", "64",
                 "--tune-steps", "-1"]) == 2
    assert "--tune-steps must be 0 or more, got -1" in capsys.readouterr().out
    assert main(["quantize", src, str(tmp_path / "c"), "--method", "rtn", "--group-size", "64",
                 "--calib-samples", "4", "--calib-seqlen", "32"]) == 0
    assert "tuning samples" not in capsys.readouterr().out  # RTN stays the plain baseline
