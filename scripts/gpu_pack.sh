#!/usr/bin/env bash
# Packs, on this machine, what scripts/gpu_check.sh needs on the lent GPU machine and cannot fetch
# there (it has no network): the folder .gpu/ (git-ignored), which the device tool's `carry` takes.
#
#   bash scripts/gpu_pack.sh          # once per session, before the device run (about a minute)
#   bash scripts/gpu_pack.sh --sources-only --dest DIR   # only LMDeploy's sources (the dry run's need)
#
# .gpu/wheels/   Python 3.12 x86_64 wheels of what LMDeploy 0.18's PyTorch engine imports and the
#                GPU image lacks, or holds at a version LMDeploy's transformers pin refuses
#                (transformers 4.57 refuses tokenizers 0.23 and huggingface_hub 1.x at import).
#                Versions: this venv's own (pip freeze), so both machines run the same ones.
# .gpu/lmdeploy.tar.gz LMDeploy 0.18.0's Python sources from this venv (a site-packages tree),
#                without TurboMind's binaries (381 MB, built for CPython 3.11; the PyTorch
#                engine never imports them). The wheel itself would not fit the device tool's
#                64 MiB limit.
# .gpu/tokenizer/ SmolLM2-135M-Instruct's tokenizer files: the engine check builds a random model
#                at SmolLM2's shapes there (its 270 MB of weights cannot travel).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
DEST="$ROOT/.gpu"
sources_only=0
while (( $# )); do
  case "$1" in
    --sources-only) sources_only=1 ;;
    --dest) DEST="$(realpath -m "$2")"; shift ;;
    *) echo "gpu_pack: unknown argument $1 (--sources-only, --dest DIR)" >&2; exit 2 ;;
  esac
  shift
done
[[ -x "$PY" ]] || { echo "gpu_pack: run 'bash scripts/bootstrap.sh' first (no .venv)" >&2; exit 2; }
# What the GPU image lacks (its package list: the device tool's KINDS.md), by distribution name.
# typing_extensions: pydantic 2.14 needs >= 4.16, the image's may be older. Not importlib_metadata:
# opentelemetry-api uses the standard library's on Python 3.12. No hf-xet: hub downloads only.
NEEDED=(transformers tokenizers huggingface_hub addict annotated-types pydantic pydantic_core
        typing-inspection typing_extensions mmengine-lite opentelemetry-api pybase64 pyzmq
        shortuuid termcolor xgrammar apache-tvm-ffi yapf platformdirs)

download_wheels() {  # $1: folder
  local freeze pins=() name pattern pin
  freeze="$("$PY" -m pip freeze --disable-pip-version-check 2>/dev/null)"
  for name in "${NEEDED[@]}"; do
    # pip freeze spells names its own way: match case-insensitively with - _ . as one
    pattern="^$(echo "$name" | sed 's/[-_.]/[-_.]/g')=="
    pin="$(grep -i -E "$pattern" <<<"$freeze" || true)"
    [[ -n "$pin" ]] || { echo "gpu_pack: $name is not in .venv" >&2; return 2; }
    pins+=("$pin")
  done
  echo "[gpu_pack] downloading ${#pins[@]} wheels for CPython 3.12 x86_64" >&2
  mkdir -p "$1"
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$1" "${pins[@]}" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

pack_lmdeploy() {  # $1: the .tar.gz to write
  local site
  site="$("$PY" -c 'import lmdeploy, os; print(os.path.dirname(os.path.dirname(lmdeploy.__file__)))')"
  echo "[gpu_pack] LMDeploy's Python sources from $site" >&2
  (cd "$site" && find lmdeploy lmdeploy-*.dist-info -type f ! -name '*.so' ! -name '*.a' ! -name '*.pyc' -print0 \
    | tar --null -czf "$1" -T -)
}

copy_tokenizer() {  # $1: folder
  local tok="$ROOT/.cache/models/SmolLM2-135M-Instruct" f
  if [[ ! -f "$tok/tokenizer.json" ]]; then
    echo "[gpu_pack] building SmolLM2's folder for its tokenizer (scripts/smollm2.py)" >&2
    "$PY" "$ROOT/scripts/smollm2.py" >/dev/null
  fi
  mkdir -p "$1"
  for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
    [[ -f "$tok/$f" ]] && cp "$tok/$f" "$1/"
  done
}

rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
if (( ! sources_only )); then
  download_wheels "$DEST.tmp/wheels"
  copy_tokenizer "$DEST.tmp/tokenizer"
fi
pack_lmdeploy "$DEST.tmp/lmdeploy.tar.gz"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "[gpu_pack] $(du -sm "$DEST" | cut -f1) MiB in $DEST (the device tool carries at most 64 MiB with the tree)" >&2
