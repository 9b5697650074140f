"""Suite-wide settings. Runs before any test module imports dlinfer (it imports torch, and triton
where Triton's interpreter runs the kernels)."""

import os

import pytest

# Value checks (slots inside the cache, lengths inside the block table) are on for the whole suite.
os.environ["DLINFER_CHECK_VALUES"] = "1"

# Ray (tests/lmdeploy/test_ray_executor.py): every node on the loopback address (read once, when
# Ray is imported: so here, before any test imports it), no usage reports, no token (a cluster no
# other machine can reach needs none, and Ray would otherwise write one to ~/.ray), and a node that
# gets SIGTERM stops at once (Ray's drain, for Serve replicas these clusters never run, otherwise
# waited its full 30 s at every stop).
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                  RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")

# OpenMP threads that finish a parallel region wait for the next one asleep, not spinning
# (libgomp's default spins first). The suite runs on two workers (below) of a 2-core machine, and
# torch and the cpu kernels run two threads each: a spinning thread held a core the other worker's
# process needed, and a parallel region waited for its second thread's turn. Measured on the
# 2-core Zen 1 VM (2026-11-30), 664 conformance cases of the torch and cpu vendors, beside a
# process spinning on one core: 113-125 s spinning, 80 s asleep, 62 s alone either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# No GPU: Triton kernels run through the interpreter (small shapes only, see tests/ops/cases.py and
# dlinfer/conformance).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# ... with each launch's swap of triton.language done once, not again at every helper call
# (tests/support/triton_interpreter.py); DLINFER_TEST_PLAIN_INTERPRETER=1 runs Triton's as shipped.
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DLINFER_TEST_PLAIN_INTERPRETER") != "1":
    from support import triton_interpreter  # noqa: E402

    triton_interpreter.install()


# pytest-xdist (scripts/run_tests.sh runs the suite on two workers, `--dist loadfile
# --no-loadscope-reorder`): one test file is one unit of work, so a module's engine, server or
# cluster starts once, on one worker; the Ray files are one unit between them (one Ray cluster on
# the machine at a time); and the units that take minutes are handed out first, longest first, so
# that the workers finish together instead of one running a long file alone at the end. Their
# order: seconds in a full run on the two workers of a 2-core VM (2026-11-30); the files not
# listed follow, in collection order.
GROUPS = {"tests/lmdeploy/test_ray_executor.py": "ray", "tests/lmdeploy/test_ray_steps.py": "ray",
          "tests/lmdeploy/test_ray_two_nodes.py": "ray"}
LONG_FIRST = ["tests/ops/test_suites.py", "ray", "tests/test_wheel.py", "tests/lmdeploy/test_quantized.py",
              "tests/lmdeploy/test_lmdeploy_graph.py", "tests/lmdeploy/test_tensor_parallel.py",
              "tests/test_gpu_check.py", "tests/lmdeploy/test_triton_vendor_pipeline.py"]


def _unit(nodeid: str) -> str:
    """The unit of work of a test: its file, or the group its file belongs to."""
    path = nodeid.split("::", 1)[0]
    return GROUPS.get(path, path)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with GROUPS' files as one file. (Not xdist's own loadgroup: it renames
    items through an attribute pytest 9 no longer reads, so its groups are silently ignored.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the long units first (each worker collects, the scheduler keeps the
    collection's order under --no-loadscope-reorder)."""
    if not hasattr(config, "workerinput"):
        return
    rank = {unit: i for i, unit in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: a file keeps its order
