#!/usr/bin/env bash
# The main command: set up .venv (scripts/bootstrap.sh, a no-op once done), then let
# SmolLM2-135M-Instruct answer questions through LMDeploy on the CPU via dlinfer.
# Arguments go to scripts/main_job.py (e.g. --max-new-tokens 64, --w4a16, --eager, --dtype float32).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/main_job.py" "$@"
