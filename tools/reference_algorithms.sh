#!/usr/bin/env bash
# Regenerate packages/loong-train/tests/fixtures/reference_algorithms.json: verl's algorithms on
# fixed inputs, computed in a throwaway virtual environment (verl is never a dependency of Loong).
#   tools/reference_algorithms.sh [VENV_DIR]     (default: a temporary directory, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
VERL=0.9.1
TORCH=2.15.0
venv="${1:-$(mktemp -d)/verl-reference}"
uv venv -q -p 3.11 "$venv"
VIRTUAL_ENV="$venv" uv pip install -q "verl==$VERL" "torch==$TORCH"
"$venv/bin/python" tools/reference_algorithms.py packages/loong-train/tests/fixtures/reference_algorithms.json
[ -n "${1:-}" ] || rm -rf "$(dirname "$venv")"
