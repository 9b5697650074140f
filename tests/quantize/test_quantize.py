"""`python -m dlinfer quantize` (dlinfer/quantize): the stored bytes against this file's own
rounding rules (exact), the AWQ search against round-to-nearest, the KV scales file, refusals.
The LMDeploy side (the written checkpoints through `pipeline`) is tests/lmdeploy/test_quantized.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.broken_models import gguf_file, truncated  # noqa: E402
from support.quantized_models import unpack_awq  # noqa: E402
from support.tiny_models import tiny_model  # noqa: E402

from dlinfer.__main__ import main  # noqa: E402
from dlinfer.quantize import awq, kv_scales, pack, smooth_quant, walk, writer  # noqa: E402
from dlinfer.vendor import w4_layouts  # noqa: E402


def _expected_awq(w: torch.Tensor, g: int, scale16: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q [N, K] from the stored (float16) scales and zeros: clamp(round(w / s) + z, 0, 15) in float32."""
    n, k = w.shape
    s = scale16.float().T.repeat_interleave(g, 1)            # [N, K]
    z = zero.T.repeat_interleave(g, 1).float()
    return torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int64)


@pytest.mark.parametrize("n,k,g", [(8, 32, 8), (64, 256, 128), (24, 64, 32)])
def test_awq_packing_is_lmdeploys_gemm_layout_and_exact(n, k, g):
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * torch.rand(1, k) * 3
    t = pack.awq_tensors(w, g, torch.float16)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (k, n // 8)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (k // g, n // 8)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (k // g, n)
    q, z = unpack_awq(t["qweight"]), unpack_awq(t["qzeros"])
    assert q.min() >= 0 and q.max() <= 15 and z.min() >= 0 and z.max() <= 15
    assert torch.equal(q.T, _expected_awq(w, g, t["scales"], z))
    # half a step from rounding, at most half a step more from rounding the zero point
    step = t["scales"].float().T.repeat_interleave(g, 1)
    deq = (q.T - z.T.repeat_interleave(g, 1)).float() * step
    assert ((deq - w).abs() <= step * 1.001).all()


def test_awq_nibble_order():
    """Column 8j + ORDER[i] sits in bits 4i..4i+3 of int32 j (ORDER = 0 2 4 6 1 3 5 7)."""
    values = torch.arange(8).view(1, 8)  # column c holds the value c
    word = w4_layouts.pack(values)[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert w4_layouts.pack(torch.full((1, 8), 15))[0, 0].item() == -1  # all ones, as signed int32


def test_smooth_quant_int8_is_exact():
    torch.manual_seed(0)
    w = torch.randn(16, 40)
    w[3] = 0  # an all-zero row stays zero with a finite scale
    t = smooth_quant.int8_tensors(w)
    assert t["weight"].dtype == torch.int8 and t["scale"].dtype == torch.float32 and t["scale"].shape == (16, 1)
    scale = w.abs().amax(1, keepdim=True) / 127
    expected = torch.clamp(torch.round(w / torch.where(scale == 0, 1.0, scale)), -128, 127).to(torch.int8)
    assert torch.equal(t["weight"], expected)
    assert torch.isfinite(t["scale"]).all() and t["weight"][3].eq(0).all()


def test_awq_search_beats_rtn_on_outlier_channels_and_keeps_the_function():
    """With a few large activation channels (what AWQ is for), the searched scales reduce the
    output error well below round-to-nearest; folding them changes nothing before quantisation."""
    torch.manual_seed(1)
    x = torch.randn(512, 128)
    x[:, :4] *= 40
    lin = torch.nn.Linear(128, 64, bias=False)
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.rand(128) + 0.5)
    points = awq.grid_errors(x, [lin.weight], 32, torch.float16)
    rtn = points[0][2]  # the grid's first point is RTN (s = 1)
    alpha, s, err = awq.best_point(points)
    assert (alpha, err) == awq.search_scales(x, [lin.weight], 32, torch.float16)[::2]
    assert alpha > 0 and err < 0.7 * rtn, (alpha, err, rtn)
    before = (x * norm.weight) @ lin.weight.T
    awq.fold_into_norm(norm, [lin], s)
    after = (x * norm.weight) @ lin.weight.T
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-3)


def test_duo_scales_search_never_loses_to_rtn_and_uses_the_weights_spread():
    """The duo grid starts at s = 1 (RTN, alpha reported -1), so its error is at most RTN's; with
    uniform activations and weights whose groups have one large column, mean|x|^alpha alone has
    nothing to scale (s = 1 at every alpha), while the duo scales use the weights' spread."""
    torch.manual_seed(2)
    x = torch.randn(512, 128)
    w = torch.randn(64, 128) * 0.02
    w[:, ::32] = 0.3
    points = awq.grid_errors(x, [w], 32, torch.float16, duo=True)
    rtn = points[0][2]
    alpha, s, err = awq.best_point(points)
    assert err < 0.9 * rtn and alpha >= 0 and s.shape == (128,), (alpha, err, rtn)
    assert s[::32].max() < s.median(), "the large columns get the smaller scales"
    _, s_x, err_x = awq.search_scales(torch.ones(512, 128), [w], 32, torch.float16, duo=False)
    torch.testing.assert_close(s_x, torch.ones(128))
    # the RTN point (alpha -1, s = 1) comes first, and is the whole grid at n_grid = 0
    assert points[0][0] == -1.0 and torch.equal(points[0][1], torch.ones(128))
    assert awq.search_scales(x, [w], 32, torch.float16, n_grid=0)[::2] == (-1.0, rtn)


def test_kv_scales_map_the_range_onto_int8():
    lo = torch.tensor([[-2.0, 0.5]])
    hi = torch.tensor([[1.0, 3.0]])
    scale, zero = kv_scales.scale_zero(lo, hi)
    for x, q in ((lo, -128), (hi, 127)):
        lo0 = torch.minimum(x, torch.zeros_like(x)) if q == -128 else torch.maximum(x, torch.zeros_like(x))
        torch.testing.assert_close(lo0 / scale + zero, torch.full_like(x, float(q)), rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    dst = tmp_path_factory.mktemp("q") / "llama-awq"
    assert main(["quantize", str(tiny_model("llama")), str(dst), "--method", "awq", "--kv-int8",
                 "--calib-samples", "8", "--group-size", "64"]) == 0
    return dst


def test_written_awq_folder(written, capsys):
    config = json.loads((written / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64,
                                             "zero_point": True, "version": "gemm"}
    assert (written / "tokenizer.json").is_file() and not list(written.parent.glob(".*partial*"))
    stamp = json.loads((written / writer.STAMP_FILE).read_text())
    assert stamp["method"] == "awq" and stamp["clip"] is True and stamp["group_size"] == 64
    assert stamp["recipe"] == writer.RECIPE_TAGS["awq"] != "" and stamp["calib_samples"][0] == 8
    assert stamp["scales"] == "duo"
    from safetensors import safe_open

    with safe_open(str(written / kv_scales.FILE_NAME), "pt") as f:
        assert f.metadata() == {"format": "dlinfer-kv-int8-v1"}
        assert sorted(f.keys()) == ["k_scale", "k_zero", "v_scale", "v_zero"]
        for key in f.keys():
            t = f.get_tensor(key)
            assert t.dtype == torch.float32 and t.shape == (config["num_hidden_layers"],
                                                           config["num_key_value_heads"])
        assert (f.get_tensor("k_scale") > 0).all() and (f.get_tensor("v_scale") > 0).all()


def test_cache_names_carry_the_recipe_tag():
    """Callers cache checkpoints under these names; awq's changed with the clipping search, with
    the duo scales and with the tuning, so a folder older code wrote (`...-awq-g64`,
    `...-awq-g64-clip`, `...-awq-g64-duo-clip`) is never taken for a current one."""
    assert writer.cache_name("M", "awq", 64) == "M-awq-g64-duo-clip-tune"
    assert writer.cache_name("M", "rtn", 32) == "M-rtn-g32"
    assert writer.cache_name("M", "smooth_quant") == "M-smooth_quant"


def test_awq_progress_reports_the_clipping(tmp_path, capsys):
    assert main(["quantize", str(tiny_model("llama")), str(tmp_path / "a"), "--method", "awq", "--group-size", "64",
                 "--calib-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "layer 1/2 awq" in out and "; clip q_proj" in out and "k_proj " in out.split("; clip", 1)[1]
    assert main(["quantize", str(tiny_model("llama")), str(tmp_path / "b"), "--method", "awq", "--group-size", "64",
                 "--calib-samples", "2", "--no-clip"]) == 0
    assert "; clip" not in capsys.readouterr().out


def test_progress_is_printed_per_layer(tmp_path, capsys):
    assert main(["quantize", str(tiny_model("qwen2")), str(tmp_path / "sq"), "--method", "smooth_quant",
                 "--calib-samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "layer 1/2 smooth_quant" in out and "layer 2/2 smooth_quant" in out and "wrote" in out


def _fake_src(tmp_path: Path, **config) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 1, **config}))
    from dlinfer.utils.safetensors_writer import write_tensors

    write_tensors(str(src / "model.safetensors"), {"x": torch.zeros(2)})
    (src / "tokenizer.json").write_text("{}")
    return src


@pytest.mark.parametrize("setup,argv,message", [
    (lambda t: t / "missing", [], "does not exist"),
    (lambda t: gguf_file(t), [], "is a GGUF file; LMDeploy loads HF checkpoint"),
    (lambda t: (_fake_src(t) / "tokenizer.json").unlink() or t / "src", [], "has no tokenizer"),
    (lambda t: truncated(_fake_src(t), 3), [], "model.safetensors is truncated"),
    (lambda t: (t / "empty").mkdir() or t / "empty", [], "has no config.json"),
    (lambda t: _fake_src(t, architectures=["DeepseekV2ForCausalLM"]), [], "architecture 'DeepseekV2ForCausalLM' is "
                                                                          "not supported"),
    (lambda t: _fake_src(t, architectures=["MixtralForCausalLM"]), [], "--method awq is not supported for the MoE "
                                                                       "architecture 'MixtralForCausalLM'"),
    (lambda t: _fake_src(t, quantization_config={"quant_method": "gptq"}), [], "already quantised"),
    (lambda t: _fake_src(t), ["--group-size", "128"], "q_proj has K=576 input features, not divisible by "
                                                      "--group-size 128; try --group-size 64"),
    (lambda t: _fake_src(t, hidden_size=1000, num_attention_heads=8, num_key_value_heads=8), [],
     "none of the group sizes 128, 64, 32 divides every linear's K and N (q_proj 1000x1000"),
    (lambda t: _fake_src(t), ["--group-size", "12"], "positive multiple of 8"),
    (lambda t: _fake_src(t, hidden_size=1024, num_attention_heads=16, num_key_value_heads=1, intermediate_size=2048),
     ["--group-size", "128"],
     "k_proj has N=64 output features, not divisible by --group-size 128, which LMDeploy's AWQ loader requires"),
])
def test_bad_input_refused(tmp_path, capsys, setup, argv, message):
    src = setup(tmp_path)
    assert main(["quantize", str(src), str(tmp_path / "dst"), "--method", "awq", *argv]) == 2
    assert message in capsys.readouterr().out
    assert not (tmp_path / "dst").exists()


def test_non_empty_destination_refused(tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    assert main(["quantize", str(tiny_model("llama")), str(dst), "--method", "smooth_quant"]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().out
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]


def test_calibration_text_too_short_refused(tmp_path, capsys):
    calib = tmp_path / "c.txt"
    calib.write_text("too short")
    assert main(["quantize", str(tiny_model("llama")), str(tmp_path / "d"), "--method", "smooth_quant", "--calib",
                 str(calib)]) == 2
    assert "fewer than one sample" in capsys.readouterr().out


def _checkpoint_in(dtype: torch.dtype, src: Path, dst: Path) -> Path:
    """A copy of checkpoint SRC with its weights in `dtype` (tokenizer files copied as they are)."""
    import shutil

    from transformers import AutoModelForCausalLM

    dst.mkdir()
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "config.json":
            shutil.copy2(item, dst / item.name)
    AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(dst)
    return dst


@pytest.mark.parametrize("method", ["rtn", "smooth_quant"])
def test_a_bf16_source_quantised_layer_by_layer_equals_its_float32_copy(tmp_path, method, capsys):
    """From a bf16 checkpoint the layers are widened to float32 one at a time (memory: the bf16
    model plus one float32 layer); widening is exact, so every quantised tensor equals the one a
    float32 copy of the same weights gives, and every other tensor its bf16 rounding."""
    from safetensors.torch import load_file

    bf16 = _checkpoint_in(torch.bfloat16, tiny_model("llama"), tmp_path / "bf16-src")
    f32 = _checkpoint_in(torch.float32, bf16, tmp_path / "f32-src")
    args = ["--method", method, "--calib-samples", "4", "--group-size", "32", "--kv-int8"]
    assert main(["quantize", str(bf16), str(tmp_path / "from-bf16"), *args]) == 0
    assert "in bfloat16, each layer widened to float32" in capsys.readouterr().out
    assert main(["quantize", str(f32), str(tmp_path / "from-f32"), *args]) == 0
    assert "in float32\n" in capsys.readouterr().out
    got, want = load_file(tmp_path / "from-bf16" / "model.safetensors"), load_file(tmp_path / "from-f32" /
                                                                                   "model.safetensors")
    assert sorted(got) == sorted(want)
    leaves = {name.split(".")[-1] for name in walk.LINEARS}
    quantised = [k for k in got if ".layers." in k and k.split(".")[-2] in leaves and not k.endswith(".bias")]
    assert len(quantised) == len(leaves) * 2 * (3 if method == "rtn" else 2)
    for key in got:
        expected = want[key] if key in quantised or not want[key].is_floating_point() else want[key].bfloat16()
        assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key
    for name in (kv_scales.FILE_NAME, "lm_head_input_absmax.safetensors"):
        a, b = load_file(tmp_path / "from-bf16" / name), load_file(tmp_path / "from-f32" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_the_default_group_size_is_the_largest_that_fits(tmp_path, capsys):
    """tiny llama: K 128 / 256, but k_proj's N is 64 (2 KV heads x 32), so 64 and not 128."""
    assert main(["quantize", str(tiny_model("llama")), str(tmp_path / "d"), "--method", "rtn",
                 "--calib-samples", "2"]) == 0
    assert "quantize: group size 64 (the largest of 128, 64, 32 that divides every linear's K and N)" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "d" / "config.json").read_text())["quantization_config"]["group_size"] == 64


def _ended_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_run_killed_before_its_rename_is_cleaned_up(tmp_path, capsys):
    left = tmp_path / f".d.partial-{_ended_pid()}"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    assert main(["quantize", str(tiny_model("llama")), str(tmp_path / "d"), "--method", "smooth_quant",
                 "--calib-samples", "2"]) == 0
    assert f"removed {left}, left by an interrupted run" in capsys.readouterr().out
    assert not left.exists() and (tmp_path / "d" / "model.safetensors").is_file()


def test_a_run_still_writing_the_destination_is_not_disturbed(tmp_path, capsys):
    import os

    busy = tmp_path / f".d.partial-{os.getppid()}"  # a process that runs: pytest's parent
    busy.mkdir()
    assert main(["quantize", str(tiny_model("llama")), str(tmp_path / "d"), "--method", "smooth_quant"]) == 2
    assert f"another process (pid {os.getppid()}) is writing DST" in capsys.readouterr().out
    assert busy.is_dir() and not (tmp_path / "d").exists()


def test_a_calibration_file_that_is_not_text_is_warned_about(tmp_path):
    from dlinfer.quantize import calib

    binary = tmp_path / "calib.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    with pytest.warns(calib.CalibrationTextWarning, match="does not look like text"):
        calib._read(binary)
    text = tmp_path / "calib.txt"
    text.write_text("Plain text, with an odd byte: \u00e9.\n" * 50)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", calib.CalibrationTextWarning)
        assert calib._read(text).startswith("Plain text")
