#!/usr/bin/env bash
# Installs (if needed) and runs the whole test suite. .ci/run calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The Prometheus scrape test needs a real Prometheus server: Debian's package.
if ! command -v prometheus >/dev/null; then
  echo "installing Debian's prometheus package for the scrape test"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q prometheus >/dev/null 2>&1 || \
    { apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null; }
fi
# The SSE framing test drives the HTTP API with curl -N, as a user would.
if ! command -v curl >/dev/null; then
  echo "installing Debian's curl package for the SSE test"
  apt-get install -y -q curl >/dev/null 2>&1 || \
    { apt-get update -q >/dev/null && apt-get install -y -q curl >/dev/null; }
fi
# The compose file's own test reads it as Compose does (`docker-compose config`): the CLI from
# Debian's packages, before the suite starts (the container stage installs the engine itself).
if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
  echo "installing Debian's docker-compose package for the compose file's test"
  apt-get install -y -q --no-install-recommends docker-compose >/dev/null 2>&1 || \
    { apt-get update -q >/dev/null \
      && apt-get install -y -q --no-install-recommends docker-compose >/dev/null; }
fi
# Lint, format and type checks first: seconds, and a clear message before the long run.
.venv/bin/ruff check pdserve services tests bench
.venv/bin/ruff format --check pdserve services tests bench
.venv/bin/mypy  # paths and strictness: [tool.mypy] in pyproject.toml
bash scripts/buf_lint.sh
# The slowest tests are listed at the end, to see where the CI budget goes.
exec .venv/bin/python -m pytest -q --durations=25 "$@"
