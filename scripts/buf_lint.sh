#!/usr/bin/env bash
# Lints proto/ with buf's default rules. buf comes from npm (@bufbuild/buf), pinned, installed
# once into .tools/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
BUF_VERSION=1.75.0
BUF=.tools/node_modules/.bin/buf
if [[ ! -x "$BUF" ]] || [[ "$("$BUF" --version)" != "$BUF_VERSION" ]]; then
  command -v npm >/dev/null || { echo "buf lint needs npm (Node.js) to install @bufbuild/buf" >&2; exit 1; }
  echo "installing buf $BUF_VERSION from npm into .tools/"
  npm install --silent --no-audit --no-fund --prefix .tools "@bufbuild/buf@$BUF_VERSION" >/dev/null
fi
(cd proto && "../$BUF" lint)
echo "buf lint: proto/ passes (buf $BUF_VERSION, STANDARD rules)"
