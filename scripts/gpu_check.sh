#!/usr/bin/env bash
# The GPU check of the triton vendor and the dlinfer_cuda device type (issue 31; docs/gpu.md).
#
# On the lent GPU machine (Python 3.12, torch 2.11, Triton 3.6, no LMDeploy, no network), through
# the device tool, after `bash scripts/gpu_pack.sh` here has filled .gpu/:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu"], timeout_s=600)
# Results land in $OUT (gpu_check.md, gpu_check.json, gpu_check.log, the conformance reports).
#
# Here, before any GPU minute is spent (every step on the CPU, interpreted, tiny shapes, <= 3 min):
#   bash scripts/gpu_check.sh --dry-run [--out DIR]
#
# Other arguments go to scripts/gpu_check.py (--steps engine,ops to rerun some, --deadline S).
set -uo pipefail
export GPU_CHECK_T0="$(date +%s)"  # gpu_check.py's --deadline counts from here (the wheel install included)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
dry=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && dry=1; done
SITE="$(mktemp -d /tmp/dlinfer-gpu-site.XXXXXX)"
trap 'rm -rf "$SITE"' EXIT
PACK="$ROOT/.gpu"
(( dry )) && { bash scripts/bootstrap.sh || exit 2; }
if [[ ! -f "$PACK/lmdeploy.tar.gz" ]]; then
  if (( ! dry )); then
    echo "gpu_check: .gpu/ is missing: run 'bash scripts/gpu_pack.sh' here first (and carry .gpu)" >&2
    exit 2
  fi
  PACK="$SITE/pack" && bash scripts/gpu_pack.sh --sources-only --dest "$PACK" || exit 2
fi
# LMDeploy as it travels (its sources without TurboMind's binaries), on both sides: the dry run
# proves that this copy is enough for the PyTorch engine.
tar -xzf "$PACK/lmdeploy.tar.gz" -C "$SITE" || { echo "gpu_check: $PACK/lmdeploy.tar.gz did not unpack" >&2; exit 2; }
if (( dry )); then
  PY="$ROOT/.venv/bin/python"
  export TRITON_INTERPRET=1
else
  PY="$(command -v python3)"
  echo "[gpu_check] installing $(ls .gpu/wheels/*.whl | wc -l) carried wheels into $SITE" >&2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .gpu/wheels/*.whl || { echo "gpu_check: the carried wheels did not install" >&2; exit 2; }
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# the engine's SmolLM2-shaped model takes SmolLM2's tokenizer from the carried folder
tok=()
[[ -f "$PACK/tokenizer/tokenizer.json" ]] && tok=(--tokenizer "$PACK/tokenizer")
"$PY" scripts/gpu_check.py "${tok[@]}" "$@"
