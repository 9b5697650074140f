"""The triton vendor's W4A16 kernel split over K (few rows of x: the decode shapes).

At M = 1 the group kernel has one program per 64 output columns, each walking all of K: on the
H200 (docs/gpu.md) K = 4096, N = 11008 read the weight at ~11% of HBM's rate. The launcher now
splits K for few rows (`_group_splits`), stores fp32 partials and sums them in a fixed order.
Here: the rule's numbers, the split path's values against a float64 reference (forced splits,
including ranges of unequal length, bias, zero points, both layouts, all dtypes), determinism,
and that the split launches compile for sm_80 / sm_90 without spilling (no GPU needed).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

from dlinfer.conformance import reference_quant as R  # noqa: E402
from dlinfer.conformance.compare import assert_close  # noqa: E402
from dlinfer.conformance.suites.weight_quant import awq_pack, column_tile  # noqa: E402
from dlinfer.vendor.triton import weight_quant as W  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_split_rule():
    # the H200's decode shape: 172 column tiles for 132 SMs -> 4 ranges of 8 K steps each
    assert W._group_splits(1, 4096, 128, 172, 132) == 4
    # fewer columns: more ranges, but every range keeps at least 4 K steps
    assert W._group_splits(1, 4096, 128, 16, 132) == 8
    # the partials' bytes bound splits * M <= K / 64
    assert W._group_splits(16, 4096, 128, 172, 132) == 4
    assert W._group_splits(64, 4096, 64, 172, 132) == 1
    # enough programs already (prefill), or a CPU (one "SM"), or a short K: no split
    assert W._group_splits(4096, 4096, 64, 32 * 172, 132) == 1
    assert W._group_splits(1, 4096, 128, 172, 1) == 1
    assert W._group_splits(1, 256, 128, 1, 132) == 1


def _weights(k, n, group, dtype, zeros, bias, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int64)
    z = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int64)
    s = (torch.rand(k // group, n, generator=g, dtype=torch.float64) + 0.5) / (5.0 * k**0.5)
    s = torch.where(torch.rand(k // group, n, generator=g) < 0.5, -s, s).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return awq_pack(q), s, awq_pack(z) if zeros else None, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("tiled", [False, True])
def test_split_matches_float64(dtype, splits, tiled):
    # K = 320 with group 64: 5 K steps of 64 rows -> 3 splits leave ranges of unequal length (2, 2, 1)
    k, n, group, m = 320, 136, 64, 3
    qweight, scale, offset, bias = _weights(k, n, group, dtype, zeros=splits != 5, bias=splits != 2, seed=splits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = R.weight_quant_matmul(x, qweight, scale, offset, bias, group)
    packed = column_tile(qweight) if tiled else qweight
    args = [t.to(DEVICE) if t is not None else None for t in (x, packed, scale, offset, bias)]
    out = W.weight_quant_matmul(*args, group, num_splits=splits)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out.cpu(), expected, "weight_quant_matmul")
    one = W.weight_quant_matmul(*args, group, num_splits=1)
    if dtype == torch.float32:  # one range vs several: the same terms summed in another fp32 order
        torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)
    again = W.weight_quant_matmul(*args, group, num_splits=splits)
    assert torch.equal(out, again)  # a fixed order: the same bits every call


def test_more_splits_than_steps_leaves_none_empty():
    k, n, group = 128, 64, 32
    qweight, scale, offset, bias = _weights(k, n, group, torch.float32, zeros=True, bias=True, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    expected = R.weight_quant_matmul(x, qweight, scale, offset, bias, group)
    args = [t.to(DEVICE) for t in (x, qweight, scale, offset, bias)]
    out = W.weight_quant_matmul(*args, group, num_splits=64)  # 4 K steps at most: 4 ranges
    assert_close(out.cpu(), expected, "weight_quant_matmul")


@pytest.mark.parametrize("bias", [False, True])
def test_empty_k_gives_the_bias_or_zeros(bias):
    # K = 0: no K step, no split (the rule once divided by zero here); y = bias, or 0
    n, group = 64, 32
    x = torch.zeros(2, 0, dtype=torch.bfloat16, device=DEVICE)
    q = torch.zeros(0, n // 8, dtype=torch.int32, device=DEVICE)
    s = torch.zeros(0, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE) if bias else None
    out = W.weight_quant_matmul(x, q, s, None, b, group)
    want = b.expand(2, n) if bias else torch.zeros(2, n, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(out, want)


def _compiled_env():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    return env


def test_split_launches_fit_sm80_sm90_and_do_not_spill(tmp_path):
    # the decode shape's launches, recorded (nothing runs) and compiled for both targets
    (tmp_path / "rec.py").write_text(
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(REPO / 'scripts')!r})\n"
        "import triton_targets as T\n"
        "from dlinfer.vendor.triton import weight_quant as W\n"
        "rec = T.Recorder()\n"
        "with rec:\n"
        "    for dtype in (torch.bfloat16, torch.float16, torch.float32):\n"
        "        x = torch.zeros(1, 4096, dtype=dtype)\n"
        "        q = torch.zeros(4096, 11008 // 8, dtype=torch.int32)\n"
        "        s = torch.zeros(32, 11008, dtype=dtype)\n"
        "        W.weight_quant_matmul(x, q, s, q[:32], s[0], 128, num_splits=4)\n"
        "rows = []\n"
        "for fn, sig, const, opts, consts in rec.launches.values():\n"
        "    for cc in (80, 90):\n"
        "        rows.append(dict(kernel=fn.fn.__name__, cc=cc, split=consts.get('SPLIT'),\n"
        "                         **T.compile_for(fn, sig, const, opts, cc)))\n"
        f"open({str(tmp_path / 'rows.json')!r}, 'w').write(json.dumps(rows, default=str))\n")
    proc = subprocess.run([sys.executable, str(tmp_path / "rec.py")], env=_compiled_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["kernel"] for r in rows} == {"_w4_group_kernel", "_split_sum_kernel"}, rows
    assert any(r["kernel"] == "_w4_group_kernel" and r["split"] is True for r in rows), rows
    assert all(r["ok"] and r["spill_bytes"] == 0 for r in rows), rows
