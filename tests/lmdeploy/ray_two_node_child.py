"""Run by test_ray_two_nodes.py in a subprocess: a tp=2 pipeline over the Ray cluster at
RAY_ADDRESS (two nodes), with this process's environment free of the suite's loopback-only Ray
setting.

    python tests/lmdeploy/ray_two_node_child.py MODEL_DIR NEW_TOKENS PROMPT [PROMPT ...]

With DLINFER_TEST_STACKS_AFTER_S set, a run still going after that many seconds prints its
threads' stacks to stderr and exits (the test then shows them).

Prints one JSON line: {"node_ips": [each rank's node address], "steps": the class the executor sent
its steps through, "results": [Generated as a dict]}.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: a script, not a pytest module

from support.engine_helpers import cpu_pipeline, greedy_generate  # noqa: E402


def main(model_dir: str, new_tokens: str, *prompts: str) -> None:
    import faulthandler
    import os

    import ray

    stacks_after = os.environ.get("DLINFER_TEST_STACKS_AFTER_S")
    if stacks_after:  # the test's limit is near: every thread's stack to stderr, then exit
        faulthandler.dump_traceback_later(float(stacks_after), exit=True)

    with cpu_pipeline(Path(model_dir), tp=2, distributed_executor_backend="ray") as pipe:
        executor = pipe.async_engine.engine.executor
        node_ips = ray.get([worker.get_node_ip.remote() for worker in executor.workers])
        results = greedy_generate(pipe, list(prompts), int(new_tokens))
        steps = type(executor.__dict__.get("_dlinfer_steps")).__name__
    print(json.dumps({"node_ips": node_ips, "steps": steps, "results": [dataclasses.asdict(r) for r in results]}),
          flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
