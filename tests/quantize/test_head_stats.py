"""The LM head input's calibration ranges (dlinfer/quantize/head_stats.py): what `quantize` writes,
the file's checks, and the smoothing factors the int8 head takes from them."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import tiny_model  # noqa: E402

from dlinfer.__main__ import main  # noqa: E402
from dlinfer.quantize import calib, head_stats  # noqa: E402


def test_quantize_writes_the_ranges_of_the_float_heads_input(tmp_path, capsys):
    """RTN leaves the float model as it is, so the file holds max |x_j| of the float model's LM head
    input over the calibration tokens, as HF transformers computes it (captured at the head)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dst = tiny_model("llama"), tmp_path / "rtn"
    assert main(["quantize", str(src), str(dst), "--method", "rtn", "--group-size", "64",
                 "--calib-samples", "4"]) == 0
    assert "the LM head's input ranges recorded" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = calib.samples(AutoTokenizer.from_pretrained(src), None, 128, 4)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(input_ids=ids)
    expected = seen[0].double().abs().reshape(-1, seen[0].shape[-1]).amax(0).float()
    ranges = head_stats.load(dst, model.config.hidden_size)
    assert ranges is not None and ranges.dtype == torch.float32
    torch.testing.assert_close(ranges, expected, rtol=1e-5, atol=1e-6)


def test_load_round_trip_and_a_folder_without_the_file(tmp_path):
    values = torch.tensor([0.0, 1.5, 3.25])
    head_stats.save(tmp_path / head_stats.FILE_NAME, values)
    assert torch.equal(head_stats.load(tmp_path, 3), values)
    assert head_stats.load(tmp_path / "elsewhere", 3) is None


@pytest.mark.parametrize("values,size,match", [
    (torch.ones(3), 4, r"float32 \[4\].*got torch.float32 \[3\]"),
    (torch.ones(4, dtype=torch.float64), 4, r"float32 \[4\].*got torch.float64"),
    (torch.tensor([1.0, -1.0, 0.0, 2.0]), 4, r"finite values >= 0"),
    (torch.tensor([1.0, float("nan"), 0.0, 2.0]), 4, r"finite values >= 0"),
])
def test_load_refuses_a_bad_file_naming_it(tmp_path, values, size, match):
    from safetensors.torch import save_file

    save_file({head_stats.NAME: values}, str(tmp_path / head_stats.FILE_NAME), metadata={"format": head_stats.FORMAT})
    with pytest.raises(ValueError, match=head_stats.FILE_NAME + ".*" + match):
        head_stats.load(tmp_path, size)


def test_load_refuses_another_format(tmp_path):
    from safetensors.torch import save_file

    save_file({"absmax": torch.ones(4)}, str(tmp_path / head_stats.FILE_NAME), metadata={"format": "other"})
    with pytest.raises(ValueError, match=r"format 'other'"):
        head_stats.load(tmp_path, 4)


def test_smoothing_balances_the_two_ranges():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 6, generator=g)
    weight[:, 4] = 0.0  # a dead weight column
    xmax = torch.rand(6, generator=g) * 10
    xmax[2] = 0.0  # a channel the calibration never saw move
    s = head_stats.smoothing(xmax, weight)
    wmax = weight.double().abs().amax(0)
    expected = (xmax.double().sqrt() / wmax.sqrt()).float()
    expected[2] = expected[4] = 1.0
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, expected, rtol=1e-6, atol=0)
    live = [0, 1, 3, 5]  # after smoothing both sides of a live channel have the same range
    torch.testing.assert_close((xmax / s)[live], (weight.abs().amax(0) * s)[live], rtol=1e-5, atol=0)
