#!/usr/bin/env bash
# Create .venv with Python 3.12 and install k2jax into it (extras as arguments: tools/setup.sh test).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/find_python.sh
py=${PYTHON312:-$(find_python 3.12)}
[[ -x .venv/bin/python ]] || "$py" -m venv .venv
extras=$(IFS=,; echo "$*")
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".${extras:+[$extras]}"
echo "k2jax installed in .venv: run .venv/bin/k2jax --help"
