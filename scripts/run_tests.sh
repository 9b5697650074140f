#!/usr/bin/env bash
# The whole test suite: bootstraps .venv (scripts/bootstrap.sh), then runs pytest over tests/ (or the paths given).
# Value checks of every op are on (DLINFER_CHECK_VALUES=1); Triton kernels run on the CPU through
# Triton's interpreter (TRITON_INTERPRET=1) unless a GPU is present. Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export DLINFER_CHECK_VALUES=1
if ! "$ROOT/.venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=15 "$@"
