"""Prefill-sized `linear` on CPU: which GEMM the installed torch offers is fastest at large M.

    .venv/bin/python benchmarks/bench_prefill_linear.py [--rows 512 1024] [--repeats 5]

SmolLM2-135M's four projections (K x N: qkv 576 x 960, o 576 x 576, gate_up 576 x 3072,
down 1536 x 576) at M rows, float32 and bfloat16, through:
- `onednn`: `torch.ops.mkldnn._linear_pointwise` on the plain weight (what the cpu vendor runs
  beyond 8 rows in float32, via the torch vendor's linear);
- `aten`: `F.linear` (MKL sgemm in float32; oneDNN in bf16: the bf16 path today);
- `onednn-packed`: the same oneDNN op on a weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU backend does at compile time);
- `mkl-packed` (float32): `torch.ops.mkl._mkl_linear` on an MKL-packed weight
  (`torch.ops.mkl._mkl_reorder_linear_weight`).
The candidates alternate within each repeat (paired); a cell is the best of the repeats' medians,
summed over the four projections, with GFLOP/s.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_cpu_ops import median_time  # benchmarks/ is on sys.path when this file runs

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}




def candidates(w: torch.Tensor, m: int) -> dict:
    out = {"onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
           "aten": lambda x: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        out["onednn-packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        print(f"onednn-packed unavailable for {w.dtype}: {exc}")
    if w.dtype == torch.float32 and torch.backends.mkl.is_available():
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        out["mkl-packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, w, None, m)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M projections, "
          f"candidates alternated {args.repeats}x")
    print("| dtype | M | candidate | ms (4 projections) | GFLOP/s | vs onednn (today's fp32) / aten (today's bf16) |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for m in args.rows:
                g = torch.Generator().manual_seed(m)
                per_shape = []
                for k, n in SHAPES.values():
                    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
                    x = torch.randn(m, k, generator=g).to(dtype)
                    cands = candidates(w, m)
                    ref = F.linear(x.double(), w.double())
                    for name, fn in cands.items():  # every candidate computes the same product
                        err = (fn(x).double() - ref).abs().max().item()
                        assert err < (1e-3 if dtype == torch.float32 else 0.1), (name, err)
                    per_shape.append((x, cands))
                best = {}
                for _ in range(args.repeats):
                    for name in per_shape[0][1]:
                        t = sum(median_time(lambda: c[name](x)) for x, c in per_shape)
                        best[name] = min(best.get(name, float("inf")), t)
                flops = sum(2 * m * k * n for k, n in SHAPES.values())
                today = "onednn" if dtype == torch.float32 else "aten"
                for name, t in best.items():
                    print(f"| {str(dtype)[6:]} | {m} | {name} | {t * 1e3:.2f} | {flops / t / 1e9:.0f} | "
                          f"{best[today] / t:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
