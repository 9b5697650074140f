"""`dlinfer.ops.linear(..., all_reduce=True)` over a real two-process gloo group.

Tensor parallel's row split: each of 2 ranks holds K/2 input columns of x and of the weight; the
sum over the group of the partial products is the full product. Checked against a float64
reference of the unsplit product computed here, for the default group ("") and an explicit one;
with all_reduce=False each rank keeps its partial product. The processes are spawned (no fork of
a process with OpenMP threads) and bounded by a timeout.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
M, K, N = 5, 64, 24
TIMEOUT_S = 120


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=gen, dtype=torch.float64)
    w = torch.randn(N, K, generator=gen, dtype=torch.float64)
    b = torch.randn(N, generator=gen, dtype=torch.float64)
    return x, w, b


def _rank(rank: int, port: int, results) -> None:
    import dlinfer.ops as ops

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, w, b = _inputs()
        cols = slice(rank * K // WORLD, (rank + 1) * K // WORLD)
        xs, ws = x[:, cols].float().contiguous(), w[:, cols].float().contiguous()
        bias = b.float() if rank == 0 else torch.zeros(N)  # the bias once, as LMDeploy's row split does
        group = dist.new_group(list(range(WORLD)), backend="gloo")
        out = {
            "default": ops.linear(xs, ws, bias, all_reduce=True),
            "group": ops.linear(xs.view(1, M, K // WORLD), ws, bias, all_reduce=True, group=group)[0],
            "local": ops.linear(xs, ws, bias, all_reduce=False),
        }
        results[rank] = {k: v.double() for k, v in out.items()}
    finally:
        dist.destroy_process_group()


def test_linear_all_reduce_sums_the_row_split_over_gloo():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _port()
        procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0] * WORLD
        got = dict(results)
    from dlinfer.conformance.tolerances import tolerance

    atol, rtol = tolerance("linear", torch.float32)  # the one table (docs/tools.md, "Tolerances")
    x, w, b = _inputs()
    full = x @ w.T + b
    for rank in range(WORLD):
        cols = slice(rank * K // WORLD, (rank + 1) * K // WORLD)
        partial = x[:, cols] @ w[:, cols].T + (b if rank == 0 else 0)
        torch.testing.assert_close(got[rank]["default"], full, rtol=rtol, atol=atol)
        torch.testing.assert_close(got[rank]["group"], full, rtol=rtol, atol=atol)
        torch.testing.assert_close(got[rank]["local"], partial, rtol=rtol, atol=atol)
        assert not torch.allclose(got[rank]["local"], full, atol=1e-2)  # the reduction did something
