#!/usr/bin/env bash
# The whole test suite: bootstraps .venv (scripts/bootstrap.sh), then runs pytest over tests/ (or the paths given).
# Value checks of every op are on (DLINFER_CHECK_VALUES=1); Triton kernels run on the CPU through
# Triton's interpreter (TRITON_INTERPRET=1) unless a GPU is present. ruff checks dlinfer/, tests/,
# benchmarks/ and scripts/ first. Extra args go to pytest; `--fast` first runs the tests not marked slow.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export DLINFER_CHECK_VALUES=1
if ! "$ROOT/.venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
# The linter first (pyproject.toml [tool.ruff]): a style or import error fails the run in seconds.
"$ROOT/.venv/bin/python" -m ruff check --no-cache dlinfer tests benchmarks scripts
# --fast: the fast lane for iteration, every test not marked slow (a few minutes); the README
# command runs everything.
if [[ "${1:-}" == "--fast" ]]; then
  shift
  set -- -m "not slow" "$@"
fi
# Two pytest-xdist workers where the machine has two cores or more (most of the suite runs one
# Python thread at a time: the interpreted Triton kernels, compiles, engine and server start-ups);
# tests/conftest.py makes each test file one unit of work. DLINFER_TEST_WORKERS sets the count;
# 0 runs in this process (as `-n 0` after the command does, for --pdb or -s).
WORKERS="${DLINFER_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}"
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=15 -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
