#!/usr/bin/env bash
# Downloads wheels for pdserve's dependencies (and its build backend) into deploy/wheels/, which
# the Docker build installs from with `pip --no-index`: nothing inside the build needs the network.
# Skips when the wheels already match pyproject.toml (FORCE=1 downloads again).
#
# torch must be the CPU build. Where pip resolves torch==2.13.0 to the CUDA build (plain PyPI on
# Linux), point pip at PyTorch's CPU wheel index first, e.g. with PIP_EXTRA_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${WHEELS_DIR:-deploy/wheels}
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=$(command -v python3.11 || command -v python3)

# What to fetch: the runtime dependencies and the build-system requirements, from pyproject.toml.
REQS=$("$PY" - <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    meta = tomllib.load(f)
print("\n".join(meta["project"]["dependencies"] + meta["build-system"]["requires"]))
EOF
)
STAMP="$OUT/.requirements"
if [[ -z "${FORCE:-}" && -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$REQS" ]] \
   && compgen -G "$OUT/torch-*.whl" >/dev/null; then
  echo "wheels in $OUT match pyproject.toml; skipping (FORCE=1 downloads again)"
  exit 0
fi

rm -rf "$OUT"
mkdir -p "$OUT"
printf '%s\n' "$REQS" >"$OUT/requirements.txt"
echo "downloading wheels for: $(tr '\n' ' ' <"$OUT/requirements.txt")"
# The image runs CPython 3.11 on x86-64 glibc (Debian 12), like this host: fetch for this
# interpreter, binary wheels only.
if ! "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    -d "$OUT" -r "$OUT/requirements.txt" >"$OUT/.pip.log" 2>&1; then
  grep -v "^WARNING: Location" "$OUT/.pip.log" >&2
  echo "error: pip download failed" >&2
  exit 1
fi
rm -f "$OUT/.pip.log"

if compgen -G "$OUT/nvidia_*.whl" >/dev/null || ! compgen -G "$OUT/torch-*+cpu*.whl" >/dev/null; then
  if [[ -z "${ALLOW_CUDA_TORCH:-}" ]]; then
    ls "$OUT" >&2
    echo "error: pip resolved torch to a non-CPU build (see above); point pip at the CPU wheel" \
         "index (PIP_EXTRA_INDEX_URL) or set ALLOW_CUDA_TORCH=1" >&2
    rm -rf "$OUT"
    exit 1
  fi
fi
printf '%s\n' "$REQS" >"$STAMP"
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
