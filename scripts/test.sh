#!/usr/bin/env bash
# Installs (if needed) and runs the whole test suite. .ci/run calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q "$@"
