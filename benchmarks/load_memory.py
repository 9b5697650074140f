"""Peak memory while LMDeploy loads a model on CPU through dlinfer, against the weights' size.

    .venv/bin/python benchmarks/load_memory.py MODEL_DIR [--dtype bfloat16] [--tokens 8] [--graph]

Starts `lmdeploy.pipeline(MODEL_DIR, PytorchEngineConfig(device_type="cpu", ...))`, generates
`--tokens` tokens from a short prompt, and samples every 20 ms the resident memory of this process
and every process it started (the engine may run in a child): RSS, and its anonymous and
file-backed parts (/proc/PID/status: RssAnon, RssFile; file pages are a mapped checkpoint's, which
the kernel may drop, anonymous ones are the copies). Prints the peaks, the weights' bytes (the
checkpoint's tensors in `--dtype`) and peak RSS / weights, and the issue's bound: 1.25 x weights +
1 GiB. `--cache-share` is the KV cache's share of free memory (default 0.02: the load, not the
cache, is what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30


def _status(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _tree(pid: int) -> list:
    """pid and its descendants (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


class Sampler(threading.Thread):
    def __init__(self, period: float = 0.02):
        super().__init__(daemon=True)
        self.period, self.stop_flag = period, threading.Event()
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.phase, self.peak_phase = "start", {}

    def run(self):
        while not self.stop_flag.is_set():
            total = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
            for pid in _tree(os.getpid()):
                s = _status(pid)
                for k in total:
                    total[k] += s.get(k, 0)
            for k, v in total.items():
                if v > self.peak[k]:
                    self.peak[k] = v
                    self.peak_phase[k] = self.phase
            time.sleep(self.period)


def weight_bytes(folder: Path, dtype_bytes: int) -> int:
    """Bytes of the checkpoint's tensors if stored in a dtype of `dtype_bytes` (from the headers)."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in meta["shape"]:
                count *= d
            total += count * dtype_bytes
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "auto"))
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--graph", action="store_true", help="graph mode (default eager)")
    parser.add_argument("--cache-share", type=float, default=0.02)
    args = parser.parse_args(argv)
    folder = Path(args.model)
    sampler = Sampler()
    sampler.start()
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    import dlinfer.framework.lmdeploy_ext  # noqa: F401

    baseline = sampler.peak["VmRSS"]
    start = time.perf_counter()
    sampler.phase = "load"
    config = PytorchEngineConfig(device_type="cpu", dtype=args.dtype, eager_mode=not args.graph, max_batch_size=1,
                                 session_len=512, cache_max_entry_count=args.cache_share)
    pipe = pipeline(str(folder), backend_config=config, log_level="ERROR")
    loaded = time.perf_counter() - start
    sampler.phase = "generate"
    out = pipe(["Hello, my name is"], gen_config=GenerationConfig(max_new_tokens=args.tokens, do_sample=False,
                                                                  ignore_eos=True))
    sampler.phase = "done"
    time.sleep(0.1)
    sampler.stop_flag.set()
    sampler.join()
    dtype_bytes = 4 if args.dtype == "float32" else 2
    weights = weight_bytes(folder, dtype_bytes)
    peak = sampler.peak
    bound = 1.25 * weights + GIB
    print(f"model {folder.name}, {args.dtype}, {'graph' if args.graph else 'eager'}: weights {weights / GIB:.2f} GiB; "
          f"loaded in {loaded:.1f} s; generated {out[0].generate_token_len} tokens")
    print(f"before the import of LMDeploy: {baseline / GIB:.2f} GiB RSS")
    for key, label in (("VmRSS", "RSS"), ("RssAnon", "anonymous"), ("RssFile", "file-backed")):
        print(f"peak {label}: {peak[key] / GIB:.2f} GiB ({peak[key] / weights:.2f} x weights; "
              f"during {sampler.peak_phase.get(key)})")
    verdict = "within" if peak["VmRSS"] <= bound else "OVER"
    print(f"bound 1.25 x weights + 1 GiB = {bound / GIB:.2f} GiB: peak RSS {verdict}")
    pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
