"""Run by test_tensor_parallel.py in a subprocess: a tp=2 CPU pipeline that the test breaks.

    python tests/lmdeploy/tp_child.py MODEL_DIR

Prints one JSON line {"ranks": [pid, ...]} once the engine is built, then generates for ever: the
test kills a rank (or hands over a model whose weights a rank cannot load) and expects this process
to end with a nonzero status, its ranks with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: a script, not a pytest module

from support.engine_helpers import cpu_pipeline, greedy_generate  # noqa: E402


def main(model_dir: str) -> None:
    with cpu_pipeline(Path(model_dir), tp=2) as pipe:
        ranks = [proc._proc.pid for proc in pipe.async_engine.engine.executor.procs]
        print(json.dumps({"ranks": ranks}), flush=True)
        while True:
            greedy_generate(pipe, ["Quick red river"], 8)


if __name__ == "__main__":
    main(sys.argv[1])
